"""Compile-only checks of the CuTe DSL pending-mode kernels (cute/pending.py: the step;
flush.py `PendingFold`: the fold), every format, every target (CPU CI).

Properties, not instruction counts: the step reads the read copy once for all the call's
tokens on the tensor cores (f16 MMAs for the read-copy dots, bf16 for B_j . C_t and the
replay, no tf32), with one barrier, streamed (`.cs`) read-copy loads, 16-byte output and
ring stores and no state writes; the fold is the flush's (tf32 MMAs, the counter hash, the
flush's conversions) over a work list, with no output. sm_100a / sm_103a take the hardware
conversions (`cvt.rs`, e2m1x2), sm_90a none of them and its software paths instead (the
GPU tests check their bits). fp16 reads the checkpoint in the read copy's place (its
words the MMA's pairs as loaded) and its fold encodes nothing but the checkpoint. Both
kernels wait for the kernel before them once, before
their first global load; the split step's two launches are the step with a row filter;
each kernel's registers (cuobjdump) allow the CTAs an SM it is compiled for, and the
documented spill-free variants spill nothing.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl (pip install -e '.[cute]')")

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sm_90a", "sm_100a", "sm_103a")
HEADS, GROUPS = 16, 2
FMTS = ["fp8", "nvfp4", "fp16"]
F16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
BF16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
TF32_MMA = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
ATOMIC = re.compile(r"\b(?:atom|red)(?:\.\w+)+")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(arch, format, kind) -> the module's PTX and cubin paths."""
    import torch

    from replayssm.kernels.cute.launch import compile_into
    from replayssm.kernels.cute.pending import fold_kernel, pending_kernel

    out = {}
    root = tmp_path_factory.mktemp("pending")
    for arch in ARCHS:
        for fmt in FMTS:
            for kind in ("step", "fold"):
                obj, fake = pending_kernel(fmt, arch, HEADS, GROUPS, torch.bfloat16) if kind == "step" else fold_kernel(fmt, arch, HEADS, GROUPS)
                paths = [Path(p) for p in compile_into(obj, fake, arch, root / f"{kind}-{fmt}-{arch}")]
                assert sorted(p.suffix for p in paths) == [".cubin", ".ptx"]
                out[arch, fmt, kind] = {p.suffix: p for p in paths}
    return out


@pytest.fixture(scope="module")
def ptx(compiled):
    return {key: paths[".ptx"].read_text() for key, paths in compiled.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FMTS)
def test_step_reads_the_read_copy_once_for_all_tokens(ptx, arch, fmt):
    text = ptx[arch, fmt, "step"]
    assert re.search(rf"^\.target {arch}\b", text, re.M) and text.count(".entry kernel_") == 1
    assert not re.search(r"\.local\b", text)  # every array in registers (or shared memory)
    assert F16_MMA in text and BF16_MMA in text and TF32_MMA not in text
    assert text.count("bar.sync") == 1  # the one barrier: the B_j . C_t partial tiles
    assert "cvt.rs" not in text and not re.search(r"\b(atom|red)\.", text)  # writes no state
    # The read copy streamed (evict first; docs/design.md section 10), no L1 / L2 hints.
    assert "ld.global.cs.v4.b32" in text and ".L1::" not in text and "L2::" not in text
    assert "st.global.v4.b32" in text  # outputs, x and B to the rings: 16-byte stores
    if fmt == "fp8":
        assert "cvt.rn.f16x2.e4m3x2" in text and "mul.rn.f16x2" not in text
    elif fmt == "fp16":  # the checkpoint's words as the MMA's pairs: no conversion, no scaling
        assert "e4m3" not in text and "e2m1" not in text and "mul.rn.f16x2" not in text
    else:
        # Each decoded pair times its block's scale (exact f16 products).
        assert "mul.rn.f16x2" in text and "cvt.rn.f16x2.e4m3x2" in text  # the scales (and sm_90a's codes)
        if arch == "sm_90a":
            assert "e2m1" not in text
        else:
            assert "cvt.rn.f16x2.e2m1x2" in text


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FMTS)
def test_fold_is_the_flush_fold_without_outputs(ptx, arch, fmt):
    text = ptx[arch, fmt, "fold"]
    assert re.search(rf"^\.target {arch}\b", text, re.M) and text.count(".entry kernel_") == 1
    assert not re.search(r"\.local\b", text)
    assert TF32_MMA in text and F16_MMA not in text and BF16_MMA not in text
    assert "2146121005" in text  # the hash's lowbias32 constant 0x7FEB352D
    assert "popc.b32" not in text  # a work list, not the flush's per-group flag ballot
    assert not re.search(r"\bcvt\.rn(\.satfinite)?\.f16(x2)?\.f32\b", text)  # the checkpoint never to nearest
    hw = arch != "sm_90a"
    # The checkpoint's stochastic rounding: cvt.rs on sm_100a / sm_103a, else the warp-voted
    # software path (bits.fp16x2_sr_voted: a vote, truncating pair conversions), every format.
    assert ("cvt.rs.satfinite.f16x2.f32" in text) == hw
    assert ("vote.sync.all.pred" in text) == ("cvt.rz.f16x2.f32" in text) == (not hw)
    assert ("cvt.rn.satfinite.e4m3x2.f32" in text) == (fmt != "fp16")  # FP8 codes, NVFP4 block scales
    if fmt != "nvfp4":
        assert not re.search(r"\b(atom|red)\.", text)
    else:
        assert ("cvt.rn.satfinite.e2m1x2.f32" in text) == hw and ("e2m1" in text) == hw
        atomics = set(ATOMIC.findall(text))  # the only atomic: the group amax's max
        assert atomics and all(re.fullmatch(r"(atom|red)(\.\w+)*\.global(\.\w+)*\.max\.s32", a) for a in atomics), atomics


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("fmt", FMTS)
def test_registers_allow_the_kernels_ctas_an_sm(compiled, arch, fmt):
    """From the cubins (cuobjdump; Triton's has no sm_103a, whose code is sm_100a's): the
    step's registers allow the CTAs an SM its launch asks for (`Decode.ctas_per_sm`, 4: 128 a thread;
    fp16 3: 168), the fold's its format's `fold_ctas_per_sm` (docs/design.md section 10); no spill stack in the sm_90a
    step or in the sm_100a fold (sm_90a's fold spills a few bytes by design, at 5 and 6
    CTAs an SM)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import sass_stats

    from replayssm.kernels.cute import decode, flush
    from replayssm.kernels.cute.read_copy import read_copy_format

    tool = sass_stats.default_cuobjdump()
    fmt_obj = read_copy_format(fmt, arch)
    ctas = {"step": decode.Decode(fmt_obj, HEADS, GROUPS).ctas_per_sm, "fold": fmt_obj.fold_ctas_per_sm}
    threads = {"step": 32 * decode.heads_per_cta(HEADS // GROUPS), "fold": flush.shape(64, 128).threads}
    for kind in ("step", "fold"):
        usage = subprocess.run([tool, "--dump-resource-usage", str(compiled[arch, fmt, kind][".cubin"])], capture_output=True, text=True, check=True).stdout
        regs, stack = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
        allocated = -(-regs // 8) * 8  # registers go to a warp 8 a thread at a time
        assert 0 < regs <= 255 and allocated * threads[kind] * ctas[kind] <= 65536, (kind, regs, ctas[kind])
        if (kind, arch) in (("step", "sm_90a"), ("fold", "sm_100a")):
            assert stack == 0, (kind, stack)


@pytest.mark.parametrize("kind", ["step", "fold"])
@pytest.mark.parametrize("fmt", FMTS)
def test_pending_kernels_wait_for_the_kernel_before_them(ptx, fmt, kind):
    """Both launch with programmatic dependent launch (the fold behind the plan kernel, the
    step behind the fold): one griddepcontrol.wait, before the kernel's first global load."""
    text = ptx["sm_90a", fmt, kind]
    body = text[text.index(".entry kernel_"):]
    assert body.count("griddepcontrol.wait") == 1
    assert body.index("griddepcontrol.wait") < body.index("ld.global")


@pytest.mark.parametrize("fmt", FMTS)
def test_split_step_variants_are_the_step_with_a_row_filter(ptx, fmt, tmp_path):
    """The two launches of a split step (cute/pending.py `fold_and_step`): the same MMAs,
    vector stores and PDL wait as the one-launch step; the one beside the fold ("rest")
    leaves the fold's work list alone (one scalar store fewer: the count reset), the one
    after it ("fold") resets it."""
    import torch

    from replayssm.kernels.cute.launch import compile_into
    from replayssm.kernels.cute.pending import pending_kernel

    def counts(text):
        body = text[text.index(".entry kernel_"):]
        return {
            "mma": body.count("mma.sync"), "v4": body.count("st.global.v4.b32"), "wait": body.count("griddepcontrol.wait"),
            "b32": len(re.findall(r"\bst\.global\.b32\b", body)),
        }  # fmt: skip

    whole = counts(ptx["sm_90a", fmt, "step"])
    for rows, resets in (("rest", 0), ("fold", 1)):
        obj, fake = pending_kernel(fmt, "sm_90a", HEADS, GROUPS, torch.bfloat16, rows)
        paths = compile_into(obj, fake, "sm_90a", tmp_path / rows)
        got = counts(next(Path(p) for p in paths if p.endswith(".ptx")).read_text())
        assert got == {**whole, "b32": whole["b32"] - 1 + resets}, rows


@pytest.mark.parametrize("varlen", [False, True])
def test_pending_launch_structs_are_the_specs(monkeypatch, varlen):
    """A `PendingLaunch`'s argument structs (the cache's and the plan buffer's made once, a
    call's inputs' read per call by `step_words`) are `args.raw` of the same tensors in
    the kernels' argument order, for engine-shaped inputs (x, B, C column slices of one
    projection, dt tied over the head dim, A and dt_bias strided), dense and varlen;
    the launches themselves are recorded, not run (CPU)."""
    import torch

    from replayssm import layout as L
    from replayssm.kernels.cute import args as A
    from replayssm.kernels.cute import pending as pm
    from replayssm.kernels.cute.read_copy import read_copy_format
    from replayssm.kernels.buffers import PendingPlan

    launches = []
    def recorder(*key):  # stands in for a compiled kernel's TVM-FFI entry
        return lambda *args: launches.append((key, args[:-1], args[-1]))

    monkeypatch.setattr(pm, "compiled_fold", lambda *a: recorder("fold", *a))
    monkeypatch.setattr(pm, "compiled_pending", lambda *a: recorder("step", *a))
    monkeypatch.setattr(pm, "_sm_count", lambda index: 132)
    b, T, H, G = 3, 4, 16, 2
    lead = (b * T,) if varlen else (b, T)
    width = H * 64 + 2 * G * 128 + 8  # one projection row: x | B | C | 8 more columns
    proj = torch.randn(*lead, width).to(torch.bfloat16)
    x = proj[..., : H * 64].unflatten(-1, (H, 64))
    B = proj[..., H * 64 : H * 64 + G * 128].unflatten(-1, (G, 128))
    C = proj[..., H * 64 + G * 128 : H * 64 + 2 * G * 128].unflatten(-1, (G, 128))
    dt = torch.randn(*lead, H, 1).to(torch.bfloat16).expand(*lead, H, 64)[..., 0]
    A_ = torch.randn(H, 64)[:, 0]  # columns of wider parameters: strided
    dt_bias = torch.randn(H, 64)[:, 1]
    D = torch.randn(H, 64)
    out = torch.empty(*lead, H, 64, dtype=torch.bfloat16)
    row, tok = (0, width) if varlen else (T * width, width)
    inputs = dict(x=x, dt=dt, A=A_, B=B, C=C, D=D, dt_bias=dt_bias, out=out,
                  x_row=row, x_tok=tok, dt_row=0 if varlen else T * H, dt_tok=H, dt_h=1, b_row=row, b_tok=tok,
                  c_row=row, c_tok=tok, o_row=0 if varlen else T * H * 64, o_tok=H * 64,
                  a_stride=64, bias_stride=64, d_h=64, d_p=1)  # fmt: skip
    got = pm.step_inputs(x, dt, A_, B, C, D, dt_bias, out, varlen)
    assert list(got) == list(inputs) and all(got[k] is v if torch.is_tensor(v) else got[k] == v for k, v in inputs.items())
    assert list(pm.step_words(x, dt, A_, B, C, D, dt_bias, out, varlen)) == A.raw(A.PendingInputs, **inputs)
    plan = PendingPlan(64, "cpu")
    rows = plan.view(b)
    for fmt_name in FMTS:
        fmt = read_copy_format(fmt_name, "sm_90a")
        cache = L.allocate_cache(5, H, G, fmt_name, "cpu", slot_padding=64, pending=True)
        launcher = pm.PendingLaunch(cache, plan.buf, plan.fold_list, fmt_name, "sm_90a", head_offset=3)
        launches.clear()
        launcher.fold(cache, A_, rows, plan.fold_list, 11)
        launcher.step(cache, x, dt, A_, B, C, D, dt_bias, out, rows, plan.fold_list, varlen, 12, "rest")
        ring = tuple(A.raw(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING]))
        copy = tuple(A.raw(fmt.Args, **fmt.tensors(cache, L)))
        plan_s = tuple(A.raw(A.PendingPlan, rows=rows, fold_list=plan.fold_list))
        ctas = min(b * H * 2, fmt.fold_ctas_per_sm * 132)
        ckpt = tuple(A.raw(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=3))
        fold_args = (ckpt, ring, copy, tuple(A.raw(A.FoldParams, A=A_)), plan_s, ctas)
        step_args = (ring, copy, tuple(A.raw(A.PendingInputs, **inputs)), plan_s, b)
        assert launches == [
            (("fold", fmt_name, "sm_90a", H, G, False, 64, 128), fold_args, 11),
            (("step", fmt_name, "sm_90a", H, G, torch.bfloat16, "rest", 64, 128), step_args, 12),
        ]


def test_the_pending_launch_reads_inputs_as_they_are_or_copies_them(monkeypatch):
    """`KernelBackend._pending_launch` (every pending call on a cache the CuTe kernels
    run): the plan, fold and step launches on the current stream; x, B, C the step reads
    as they are (engine-shaped [b, T, n * w] column slices of one projection, plain
    [b, T, n, w], varlen [total, n, w]) go as they are (the step's struct holds their
    addresses and strides), layouts it cannot read (float32 excepted: the API refuses it)
    go as contiguous copies of the same values, and an out the step cannot address (not
    16-byte aligned) is written through a buffer and copied back. Launches recorded, not
    run (CPU)."""
    import torch

    import replayssm.kernels as K
    from replayssm import layout as L
    from replayssm.formats import format_of
    from replayssm.kernels.cute import pending as pm
    from replayssm.kernels.cute import plan as cp

    launches = []

    class Plan:  # stands in for cute.plan.PendingPlanLaunch
        def __init__(self, cache, plan, fmt, seed, max_seqlen, arch):
            self.args = (fmt, seed, max_seqlen)

        def __call__(self, ids, accepted, cu_seqlens, stream):
            launches.append(("plan", self.args, ids.data_ptr(), accepted, cu_seqlens, stream))

    def recorder(*key):  # stands in for a compiled kernel's TVM-FFI entry
        return lambda *args: launches.append((key[0], args[:-1], args[-1]))

    monkeypatch.setattr(pm, "compiled_fold", lambda *a: recorder("fold", *a))
    monkeypatch.setattr(pm, "compiled_pending", lambda *a: recorder("step", *a))
    monkeypatch.setattr(pm, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # eager calls (a CPU build has no query)
    monkeypatch.setattr(cp, "PendingPlanLaunch", Plan)
    monkeypatch.setattr(K, "_pending_cute", lambda real=K._pending_cute(): real._replace(current_stream=lambda index: 9))
    H, G, T, b = 16, 2, 4, 3
    kb = K.KernelBackend()
    A_, D, dt_bias = torch.randn(H, 64)[:, 0], torch.randn(H, 64), torch.randn(H, 64)[:, 1]
    width = H * 64 + 2 * G * 128 + 8  # one projection row: x | B | C | 8 more columns
    proj = torch.randn(b, T, width).to(torch.bfloat16)
    x, B, C = proj[..., : H * 64], proj[..., H * 64 : H * 64 + G * 128], proj[..., H * 64 + G * 128 : -8]
    dt = torch.randn(b, T, H, 1).to(torch.bfloat16).expand(b, T, H, 64)[..., 0]
    out = torch.empty(b, T, H * 64, dtype=torch.bfloat16)
    apart = torch.empty(b, T, G, 256, dtype=torch.bfloat16)[..., :128].copy_(B.unflatten(-1, (G, 128)))
    odd = torch.empty(b * T * H * 64 + 8, dtype=torch.bfloat16)[8 - 4 : 8 - 4 + b * T * H * 64].view(b, T, H, 64)
    cache = L.allocate_cache(70, H, G, "fp8", "cpu", slot_padding=64, pending=True)
    ids = torch.arange(1, b + 1, dtype=torch.int32)
    cases = {
        "engine": ((x, B, C, out), ()),
        "plain": ((x.unflatten(-1, (H, 64)), B.unflatten(-1, (G, 128)), C.unflatten(-1, (G, 128)), out.view(b, T, H, 64)), ()),
        "B heads apart": ((x, apart, C, out), (1,)),
        "out unaligned": ((x, B, C, odd), (3,)),
    }
    for name, ((x_, B_, C_, out_), copied) in cases.items():
        ctx = K._CacheContext(cache, (None, "sm_90a"), None)
        launches.clear()
        kb._pending_launch(ctx, cache, x_, dt, A_, B_, C_, D, dt_bias, ids, out_, format_of("fp8"), 5, T, None, None, 3)
        assert [r[0] for r in launches] == ["plan", "fold", "step"], name
        assert launches[0][1:] == ((format_of("fp8"), 5, T), ids.data_ptr(), None, None, 9), name
        assert launches[1][2] == launches[2][2] == 9, name
        inputs = launches[2][1][2]  # the step's PendingInputs struct
        given = (x_, None, None, B_, C_, None, None, out_)
        for i in (0, 3, 4, 7):
            assert (inputs[i] == given[i].data_ptr()) == (i // 2 not in copied), (name, i)  # struct field i: tensor i // 2
        assert not any(p % 16 for p in (inputs[0], inputs[3], inputs[4], inputs[7])), name
    # A varlen call: [total, n, w] rows, row strides 0 in the step's struct.
    launches.clear()
    xv, Bv = x.reshape(b * T, H, 64), B.reshape(b * T, G, 128)
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    ctx = K._CacheContext(cache, (None, "sm_90a"), None)
    kb._pending_launch(ctx, cache, xv, dt.reshape(b * T, H), A_, Bv, Bv, D, dt_bias, ids, out.reshape(b * T, H, 64),
                       format_of("fp8"), 5, T, None, cu, 3)  # fmt: skip
    inputs = launches[2][1][2]
    assert launches[0][4] is cu and inputs[0] == xv.data_ptr() and inputs[8] == 0 and inputs[9] == xv.stride(0)
    # A larger batch grows the context's plan buffer (at least doubled); the outgrown one
    # stays alive for the graphs captured with it.
    first = ctx.pending
    big = 70
    xb = torch.zeros(big, T, H * 64, dtype=torch.bfloat16)
    Bb = torch.zeros(big, T, G * 128, dtype=torch.bfloat16)
    kb._pending_launch(ctx, cache, xb, torch.zeros(big, T, H), A_, Bb, Bb, D, dt_bias, torch.zeros(big, dtype=torch.int32),
                       torch.empty(big, T, H * 64, dtype=torch.bfloat16), format_of("fp8"), 5, T, None, None, 3)  # fmt: skip
    assert ctx.pending.rows == 128 and ctx.outgrown == [first] and first.rows == 64