"""Compile-only checks of the CuTe DSL decode kernels for every target (CPU CI).

No GPU is needed: `compile_all` names the target explicitly. The sm_100a / sm_103a flush
must use the hardware conversions (`cvt.rs.satfinite.f16x2.f32` for the stochastically
rounded checkpoint, `cvt.rn.satfinite.e4m3x2.f32` for the read copy); sm_90a has no
`cvt.rs` and must not emit it (its software path is what the GPU test checks bit for bit).
Both fold on the tensor cores (`mma.sync` tf32) and every target has the same number of
them; the opt-in tensor-core non-flush kernel is compiled here too.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None,
    reason="nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')",
)

ARCHS = ("sm_90a", "sm_100a", "sm_103a")



# Per flush thread (CTAs of 4 warps, flush_fp8.py): 2 state rows x 16
# columns = 16 FP16 pairs and 16 e4m3 pairs; 8 n-tiles x 2 k-steps x 2 tf32 terms = 32
# MMAs (test_flush_fragment_maps_are_bijections checks the map's n-tiles).
PAIRS = 16
FOLD_MMAS = 32


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from replayssm.kernels import compile_all

    return {arch: [Path(p) for p in compile_all(arch, tmp_path_factory.mktemp(arch))] for arch in ARCHS}


def _ptx(paths, kind):
    # FP8 folders only (compile_all also builds the NVFP4 kinds: tests/test_cute_nvfp4.py).
    return {p.parent.name: p.read_text() for p in paths if p.suffix == ".ptx" and p.parent.name.startswith(f"{kind}_fp8")}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles(compiled, arch):
    paths = compiled[arch]
    folders = {p.parent.name for p in paths}
    # Every kernel has a PDL variant (the non-flush kernels' for batch 1, the flushes' above
    # it); sm_90a: the FP8 flush's warp-voted variants too (launch.fp8_sr_voted); the FP8
    # non-flush kernel with its read hint (launch.fp8_read_hint).
    voted = {f"flush_fp8-h16g{g}{p}-voted" for g in (1, 2) for p in ("", "-pdl")} if arch == "sm_90a" else set()
    hinted = {f"decode_fp8-h16g{g}-hint" for g in (1, 2)}
    assert folders == {f"{k}_{fmt}-h16g{g}{p}" for k in ("decode", "flush") for fmt in ("fp8", "nvfp4") for g in (1, 2) for p in ("", "-pdl")} | voted | hinted
    for folder in folders:
        kinds = sorted(p.suffix for p in paths if p.parent.name == folder)
        assert kinds == [".cubin", ".ptx"], folder
    for name, text in {**_ptx(paths, "decode"), **_ptx(paths, "flush")}.items():
        assert re.search(rf"^\.target {arch}\b", text, re.M), name
        assert ".entry kernel_" in text, name


@pytest.mark.parametrize("arch", ARCHS)
def test_flush_loops_over_the_flushing_rows_only(compiled, arch):
    """Both formats' flushes take one trip per set bit of the CTA's flush mask (a
    `popc` trip count, the lowest set bit by `bfind`), not one per batch row of the CTA
    (the 16-row scan cost ~144 instructions a warp; docs/perf-notes-cute.md, session 8)."""
    flushes = {p.parent.name: p.read_text() for p in compiled[arch] if p.suffix == ".ptx" and p.parent.name.startswith("flush_")}
    assert len(flushes) == (12 if arch == "sm_90a" else 8)  # with and without PDL; sm_90a: the FP8 flush's voted variants
    for name, text in flushes.items():
        assert text.count("popc.b32") == 1 and text.count("bfind.u32") == 1, name


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_sm100_flush_uses_hardware_conversions(compiled, arch):
    for name, text in _ptx(compiled[arch], "flush").items():
        # Every checkpoint pair goes through cvt.rs and every read-copy pair through the
        # e4m3x2 cvt: 8 of each per state row a thread owns.
        assert text.count("cvt.rs.satfinite.f16x2.f32") == PAIRS, name
        assert text.count("cvt.rn.satfinite.e4m3x2.f32") == PAIRS, name
        assert text.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == FOLD_MMAS, name


def test_sm90_flush_is_software(compiled):
    from replayssm.kernels.cute.launch import sm90_e4m3

    flushes = _ptx(compiled["sm_90a"], "flush")
    assert sorted(flushes) == sorted(f"flush_fp8-h16g{g}{p}{v}" for g in (1, 2) for p in ("", "-pdl") for v in ("", "-voted"))
    for name, text in flushes.items():
        assert "cvt.rs" not in text, name
        if name.endswith("-voted"):
            # bits.fp16x2_sr_voted: one warp vote a state row (2 a thread), then its
            # normal-range path or its general one, each with a truncating conversion a
            # pair; no fma.rz (that is bits.fp16x2_sr_fma, the plain variant's).
            assert text.count("vote.sync.all") == 2, name
            assert text.count("cvt.rz.f16x2.f32") == 2 * PAIRS, name
            assert "fma.rz.f32" not in text, name
        else:
            # Stochastic rounding by bits.fp16x2_sr_fma: per value one clamp and one
            # fma.rz, per pair one truncating conversion, no warp vote.
            assert text.count("cvt.rz.f16x2.f32") == PAIRS, name
            assert text.count("fma.rz.f32") == 2 * PAIRS, name
            assert text.count("min.NaN.xorsign.abs.f32") == 2 * PAIRS, name
            assert "vote.sync.all" not in text, name
        assert text.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == FOLD_MMAS, name
        # The read-copy encode: software by default, the e4m3x2 cvt on request.
        assert ("cvt.rn.satfinite.e4m3x2.f32" in text) == (sm90_e4m3() == "hw"), name
        # The hash multiplies by the lowbias32 constants (software and hardware paths alike).
        assert "2146121005" in text, name  # 0x7FEB352D


# Warp-per-head non-flush kernel (decode_warp.py), per lane: 8 state rows x 2 chunks of
# 16 codes, decoded by 2 e4m3x2 -> f16x2 cvts a word; 4 m-tiles x 8 k-steps of the f16
# MMA; 8 k-steps of B_j . C and 4 m-tiles of the ring replay as bf16 MMAs.
WARP_CVTS, WARP_F16_MMAS, WARP_BF16_MMAS = 8 * 2 * 4 * 2, 4 * 8, 8 // 4 + 4  # B_j . C split over the 4 warps of a CTA
F16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
BF16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_reads_the_fp8_copy_with_vector_loads(compiled, simt_pdl_ptx, arch):
    decode = _ptx(compiled[arch], "decode")
    assert len(decode) == 6  # 2 geometries, each plain, PDL and with the read hint (all the warp kernel)
    for name, text in decode.items():
        assert "ld.global.v4" in text, name
        assert "cvt.rs" not in text, name
        assert text.count("cvt.rn.f16x2.e4m3x2") == WARP_CVTS, name
        assert text.count(F16_MMA) == WARP_F16_MMAS and text.count(BF16_MMA) == WARP_BF16_MMAS, name
        assert text.count("bar.sync") == 1, name  # the B_j . C partial sums
    simt = {k: v for k, v in simt_pdl_ptx[arch].items() if k.startswith("decode_fp8")}
    assert len(simt) == 2
    for name, text in simt.items():
        # SIMT ($REPLAYSSM_PDL_KERNEL=simt): 4 x 16-byte read-copy loads per thread,
        # decoded by the e4m3x2 -> f16x2 cvt.
        assert "ld.global.v4" in text and "cvt.rs" not in text, name
        assert text.count("cvt.rn.f16x2.e4m3x2") == 32, name
        assert "mma.sync" not in text, name


@pytest.mark.parametrize("arch", ARCHS)
def test_read_copy_loads_carry_their_cache_hints(compiled, arch):
    """The FP8 warp kernel's 16 read-copy loads a lane carry launch.FP8_READ_HINT in its
    `-hint` variant only; the NVFP4 warp kernel's 8 carry `.cs` but in the PDL variant
    (launch_nvfp4.NVFP4_READ_HINT)."""
    from replayssm.kernels.cute.launch import FP8_READ_HINT

    ptx = {p.parent.name: p.read_text() for p in compiled[arch] if p.suffix == ".ptx" and p.parent.name.startswith("decode_")}
    fp8_hinted = f"ld.global{FP8_READ_HINT}.v4.b32"
    for name, text in ptx.items():
        if name.startswith("decode_fp8"):
            assert text.count(fp8_hinted) == (16 if name.endswith("-hint") else 0), name
            assert "ld.global.cs" not in text, name
        else:
            assert text.count("ld.global.cs.v4.b32") == (0 if name.endswith("-pdl") else 8), name
            assert "L2::" not in text, name


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("warps_per_head", [1, 2])
def test_tensor_core_decode_variant_compiles(monkeypatch, tmp_path, arch, warps_per_head):
    """REPLAYSSM_FP8_DECODE=mma: per warp, 4 / warps_per_head m-tiles x 4 k-steps of the
    e4m3 MMA, their codes staged by one 16-byte cp.async per (m-tile, row, chunk)."""
    import cutlass.cute as cute

    from replayssm.kernels.cute import launch
    from replayssm.kernels.cute.decode_fp8_mma import DecodeFp8Mma

    monkeypatch.setenv(launch.FP8_DECODE_ENV, "mma")
    assert type(launch._kernel_object("decode_fp8", arch, 16, 2, "hw")) is DecodeFp8Mma
    obj = DecodeFp8Mma(16, 2, warps_per_head=warps_per_head)
    cute.compile(obj, *launch._fake_args("decode_fp8"), options=launch._options(arch, tmp_path))
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    m_tiles = 4 // warps_per_head
    assert ptx.count("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32") == 4 * m_tiles
    assert ptx.count("cp.async.cg.shared.global") == 4 * m_tiles
    assert "cvt.rs" not in ptx


def test_unknown_arch_is_rejected(tmp_path):
    from replayssm.kernels import compile_all

    with pytest.raises(ValueError, match="sm_90a"):
        compile_all("sm_80", tmp_path)


def test_flush_fragment_maps_are_bijections():
    """The flush's permuted column maps (flush_fp8.py): the staging positions the kernel
    writes (`_b_stage_base`, + 4 (i % 2) + i // 2 for column 8 ch + i) equal `_b_slot`,
    `_b_slot` is a permutation of the 128 columns, and lane (gq, q)'s B fragment (its 8
    n-tiles, read 4 at a time as consecutive staged floats at 64 half + 32 k + 4 gq)
    holds exactly the columns its accumulators are stored to (64 half + 16 q + 2 nt +
    {0, 1}, the lane's 16 consecutive columns, those of lane_geometry)."""
    from replayssm.kernels.cute.flush_fp8 import B_ROW, COL_PARTS, N, NT, FlushFp8, _b_slot, _b_stage_base

    width, lane_cols = N // COL_PARTS, 2 * NT
    assert (COL_PARTS, NT) == (2, 8)
    slots = [_b_slot(n) for n in range(N)]
    assert sorted(slots) == list(range(N))
    for ch in range(16):  # staging thread: columns 8 ch .. 8 ch + 7
        base = _b_stage_base(ch)
        for i in range(8):
            assert base + 4 * (i % 2) + i // 2 == _b_slot(8 * ch + i), (ch, i)
    for half in range(COL_PARTS):
        for g in range(8):  # MMA column g of n-tile nt is state column phys(nt, g)
            for nt in range(NT):
                phys = half * width + (g // 2) * lane_cols + 2 * nt + g % 2
                assert _b_slot(phys) == half * width + 32 * (nt // 4) + 4 * g + nt % 4
        # Accumulator columns 2 q, 2 q + 1 of n-tile nt: lane q's consecutive columns.
        for q in range(4):
            cols = sorted(half * width + (c // 2) * lane_cols + 2 * nt + c % 2 for nt in range(NT) for c in (2 * q, 2 * q + 1))
            first = half * width + lane_cols * q
            assert cols == list(range(first, first + lane_cols))
            for w in (2 * half, 2 * half + 1):
                assert FlushFp8.lane_geometry(32 * w + q, 0)[3] == first
    # Bank-conflict-free B fragment loads: the 8 lanes of each 16-byte load phase
    # (gq in {2 a, 2 a + 1}, q = 0..3) read distinct 4-bank groups.
    for a in range(4):
        groups = {((q * B_ROW + 4 * (2 * a + b)) % 32) // 4 for q in range(4) for b in range(2)}
        assert len(groups) == 8, a


@pytest.mark.parametrize("heads", [16, 64, 256])
@pytest.mark.parametrize("batch", [1, 45, 256, 1024, 1031])
def test_flush_grid_visits_every_row_group_once(heads, batch):
    """The persistent flush grid (flush_fp8.flush_columns), walked as the kernels walk it:
    every (head half, row group) once, and a CTA's successive groups alternate between
    the two flag words (flush_mask's `buf`, (by // step) & 1); groups of 16 rows, and of
    32 (the FP8 flush at 64 heads from batch 128 on, launch.fp8_flush_rows)."""
    from replayssm.kernels.cute.flush_fp8 import M_SPLIT, FlushFp8, flush_columns
    from replayssm.kernels.cute.flush_nvfp4 import FlushNvfp4

    for rows in (16, 32):
        _walk_grid(heads, batch, rows, M_SPLIT, flush_columns, (FlushFp8.ctas_per_sm, FlushNvfp4.ctas_per_sm, 0.0, 100.0))


def _walk_grid(heads, batch, rows, M_SPLIT, flush_columns, widths):
    hm = heads * M_SPLIT
    n_by = -(-batch // rows)
    for ctas_per_sm in widths:
        for sms in (132, 148, 1):
            columns = flush_columns(heads, ctas_per_sm, sms)
            assert columns >= 1
            n_ctas = hm * min(n_by, columns)
            seen = []
            for bid in range(n_ctas):
                step = n_ctas // hm
                groups = list(range(bid // hm, n_by, step))
                assert [(by // step) & 1 for by in groups] == [i % 2 for i in range(len(groups))]
                seen += [(bid % hm, by) for by in groups]
            assert sorted(seen) == [(h, by) for h in range(hm) for by in range(n_by)], (ctas_per_sm, sms)


def test_flush_lane_map_covers_each_state_row_half_once():
    """The two CTAs of a (row, head) and their 128 threads cover the 64 x 128 state once:
    lane_geometry's two rows x 16 columns per thread, over both halves."""
    from replayssm.kernels.cute.flush_fp8 import M_SPLIT, N, NT, P, THREADS, FlushFp8

    assert THREADS == 128
    seen = []
    for mh in range(M_SPLIT):
        for t in range(THREADS):
            _, _, rows, col0 = FlushFp8.lane_geometry(t, mh)
            assert all(32 * mh <= r < 32 * mh + 32 for r in rows)
            seen += [(r, col0 + c) for r in rows for c in range(2 * NT)]
    assert sorted(seen) == [(p, n) for p in range(P) for n in range(N)]


@pytest.mark.parametrize("flush_pdl", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
def test_flush_streams_fork_and_join(monkeypatch, overlap, flush_pdl):
    """The launchers' stream handling (no GPU: streams replaced by recorders): with
    OVERLAP the side stream waits for the current one before the kernels and the current
    one waits for the side stream after them, the flush on the side stream unless it is
    the PDL kernel (then the non-flush kernel); without it both are the current stream."""
    from replayssm.kernels.cute import launch

    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append(f"{self.name} waits {other.name}")

    main, side = Stream("main"), Stream("side")
    monkeypatch.setattr(launch.torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(launch, "_side_stream", lambda device: side)
    monkeypatch.setattr(launch, "OVERLAP", overlap)
    with launch.flush_streams("cuda", flush_pdl) as (f, n):
        calls.append("kernels")
    if not overlap:
        assert f is main and n is main
    else:
        assert (f, n) == ((main, side) if flush_pdl else (side, main))
    assert calls == (["side waits main", "kernels", "main waits side"] if overlap else ["kernels"])


@pytest.mark.parametrize("arch", ARCHS)
def test_only_the_pdl_variants_wait_for_the_prepare_kernel(compiled, simt_pdl_ptx, arch):
    """Programmatic dependent launch: the PDL variant of each kernel (the non-flush
    kernels at batch 1: FP8 and NVFP4, the warp kernels or the SIMT ones on request; the
    flushes above batch 1: both formats, the sm_90a FP8 flush's voted variant too)
    waits for the prepare kernel with one griddepcontrol.wait before its first global
    access; the other variants have none."""
    seen = 0
    texts = [(p.parent.name, p.read_text()) for p in compiled[arch] if p.suffix == ".ptx"]
    for name, text in texts + list(simt_pdl_ptx[arch].items()):
        if "-pdl" in name:
            seen += 1
            assert text.count("griddepcontrol.wait") == 1, name
            body = text[text.index(".entry"):]
            first_access = min(body.index(op) for op in ("ld.global", "st.global", "cp.async", "atom.") if op in body)
            assert body.index("griddepcontrol.wait") < first_access, name
        else:
            assert "griddepcontrol" not in text, name
    # Non-flush: FP8 and NVFP4 x 2 geometries x warp and SIMT; flush: FP8 and NVFP4 x 2
    # geometries, and on sm_90a the voted FP8 flush x 2 geometries.
    assert seen == 8 + 4 + (2 if arch == "sm_90a" else 0)


@pytest.mark.parametrize("kind", ["decode_fp8", "decode_nvfp4"])
def test_warp_kernel_as_the_pdl_variant(monkeypatch, tmp_path, kind):
    """The PDL variant of each non-flush kernel is by default the warp kernel, launched
    with PDL and waiting for the prepare kernel before its first global access;
    $REPLAYSSM_PDL_KERNEL=simt makes it the SIMT kernel, and a bad value is refused by
    name."""
    import cutlass.cute as cute

    from replayssm.kernels.cute import launch, launch_nvfp4
    from replayssm.kernels.cute.decode_fp8 import DecodeFp8
    from replayssm.kernels.cute.decode_nvfp4 import DecodeNvfp4
    from replayssm.kernels.cute.decode_warp import DecodeFp8Warp, DecodeNvfp4Warp

    fp8 = kind == "decode_fp8"
    mod = launch if fp8 else launch_nvfp4
    args = ("hw",) if fp8 else ()
    monkeypatch.delenv(launch.FP8_DECODE_ENV, raising=False)
    monkeypatch.delenv(launch_nvfp4.NVFP4_DECODE_ENV, raising=False)
    monkeypatch.setenv(launch.PDL_KERNEL_ENV, "simt")
    simt = mod._kernel_object(kind, "sm_90a", 16, 2, *args, True)
    assert isinstance(simt, DecodeFp8 if fp8 else DecodeNvfp4) and simt.pdl is True
    assert not isinstance(simt, (DecodeFp8Warp, DecodeNvfp4Warp))
    monkeypatch.delenv(launch.PDL_KERNEL_ENV, raising=False)
    warp = mod._kernel_object(kind, "sm_90a", 16, 2, *args, True)
    assert type(warp) is (DecodeFp8Warp if fp8 else DecodeNvfp4Warp) and warp.pdl is True
    assert warp.launch_options() == {"min_blocks_per_mp": warp.ctas_per_sm, "preferred_smem_carveout": -1, "use_pdl": True}
    plain = mod._kernel_object(kind, "sm_90a", 16, 2, *args)
    assert type(plain) is type(warp) and "use_pdl" not in plain.launch_options()
    cute.compile(warp, *mod._fake_args(kind), options=launch._options("sm_90a", tmp_path))
    (ptx,) = [p.read_text() for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    body = ptx[ptx.index(".entry"):]
    assert body.count("griddepcontrol.wait") == 1
    first_access = min(body.index(op) for op in ("ld.global", "st.global", "atom.") if op in body)
    assert body.index("griddepcontrol.wait") < first_access
    assert body.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 32  # the row dots
    monkeypatch.setenv(launch.PDL_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="REPLAYSSM_PDL_KERNEL"):
        launch.pdl_kernel()


def test_fp8_flush_voted_rounding_is_an_opt_in(monkeypatch):
    """launch.fp8_sr_voted: the sm_90a FP8 flush is the warp-voted variant only with
    $REPLAYSSM_SM90_FP8_SR=voted ("auto" and "plain": plain), never on sm_100a / sm_103a
    (hardware rounding); the kernel object carries the choice."""
    from replayssm.kernels.cute import launch
    from replayssm.kernels.cute.flush_fp8 import FlushFp8Sm90, FlushFp8Sm100

    for mode, voted in ((None, False), ("auto", False), ("plain", False), ("voted", True)):
        if mode is None:
            monkeypatch.delenv(launch.SM90_FP8_SR_ENV, raising=False)
        else:
            monkeypatch.setenv(launch.SM90_FP8_SR_ENV, mode)
        assert launch.fp8_sr_voted("sm_90a") is voted, mode
        assert not launch.fp8_sr_voted("sm_100a") and not launch.fp8_sr_voted("sm_103a")
    monkeypatch.setenv(launch.SM90_FP8_SR_ENV, "fast")
    with pytest.raises(ValueError, match="REPLAYSSM_SM90_FP8_SR"):
        launch.fp8_sr_voted("sm_90a")
    obj = launch._kernel_object("flush_fp8", "sm_90a", 16, 2, "hw", False, True)
    assert type(obj) is FlushFp8Sm90 and obj.sr_voted is True
    assert launch._kernel_object("flush_fp8", "sm_90a", 16, 2, "hw").sr_voted is False
    assert type(launch._kernel_object("flush_fp8", "sm_100a", 16, 2, "hw", False, True)) is FlushFp8Sm100


def test_pdl_is_for_batch_1_and_can_be_turned_off(monkeypatch):
    from replayssm.kernels.cute import launch

    monkeypatch.delenv(launch.PDL_ENV, raising=False)
    monkeypatch.delenv(launch.FP8_DECODE_ENV, raising=False)
    assert [launch.pdl_for(b) for b in (1, 2, 256)] == [True, False, False]
    assert launch.pdl_variants() == (False, True)
    # Both variants are the warp-per-head kernel, the PDL one launched with PDL.
    from replayssm.kernels.cute.decode_fp8 import DecodeFp8
    from replayssm.kernels.cute.decode_warp import DecodeFp8Warp

    obj = launch._kernel_object("decode_fp8", "sm_90a", 16, 2, "hw", True)
    assert type(obj) is DecodeFp8Warp and obj.pdl is True and obj.launch_options()["use_pdl"] is True
    obj = launch._kernel_object("decode_fp8", "sm_90a", 16, 2, "hw")
    assert type(obj) is DecodeFp8Warp and "use_pdl" not in obj.launch_options()
    # In "simt" mode both are the SIMT kernel, whatever $REPLAYSSM_PDL_KERNEL says.
    monkeypatch.setenv(launch.FP8_DECODE_ENV, "simt")
    assert launch._kernel_object("decode_fp8", "sm_90a", 16, 2, "hw").launch_options() == {}
    obj = launch._kernel_object("decode_fp8", "sm_90a", 16, 2, "hw", True)
    assert type(obj) is DecodeFp8 and obj.pdl is True and obj.launch_options() == {"use_pdl": True}
    monkeypatch.setenv(launch.FP8_DECODE_ENV, "fast")
    with pytest.raises(ValueError, match="REPLAYSSM_FP8_DECODE"):
        launch.fp8_decode()
    monkeypatch.delenv(launch.FP8_DECODE_ENV)
    assert launch.pdl_variants("decode_nvfp4") == (False, True)
    # The opt-in tensor-core FP8 kernel has no PDL variant.
    monkeypatch.setenv(launch.FP8_DECODE_ENV, "mma")
    assert launch.pdl_variants() == (False,)
    monkeypatch.delenv(launch.FP8_DECODE_ENV)
    monkeypatch.setenv(launch.PDL_ENV, "0")
    assert launch.pdl_for(1) is False and launch.pdl_variants() == (False,)
    monkeypatch.setenv(launch.PDL_ENV, "2")
    with pytest.raises(ValueError, match="REPLAYSSM_PDL"):
        launch.pdl()


def test_fp8_flush_row_groups_of_32_at_64_heads_from_batch_128(monkeypatch):
    """launch.fp8_flush_rows: 32-row groups for the FP8 flush at >= 64 heads and batch
    >= 128, else 16; $REPLAYSSM_FLUSH_ROWS forces 16 or 32 and refuses anything else;
    warmup / launch_padding cover both sizes where a step may use both, and the
    launchers build the flush with its size (the NVFP4 flush keeps 16)."""
    from replayssm.kernels.cute import launch, launch_nvfp4

    monkeypatch.delenv(launch.FLUSH_ROWS_ENV, raising=False)
    assert [launch.fp8_flush_rows(64, b) for b in (1, 127, 128, 1024)] == [16, 16, 32, 32]
    assert [launch.fp8_flush_rows(h, 1024) for h in (16, 32, 64, 128)] == [16, 16, 32, 32]
    assert launch.fp8_flush_rows_variants(16) == (16,) and launch.fp8_flush_rows_variants(64) == (16, 32)
    assert launch._kernel_object("flush_fp8", "sm_90a", 64, 8, "hw", rows=32).rows == 32
    assert launch._kernel_object("flush_fp8", "sm_100a", 64, 8, "hw").rows == 16
    assert launch_nvfp4._kernel_object("flush_nvfp4", "sm_90a", 64, 8).rows == 16
    monkeypatch.setenv(launch.FLUSH_ROWS_ENV, "32")
    assert launch.fp8_flush_rows(16, 1) == 32 and launch.fp8_flush_rows_variants(16) == (32,)
    monkeypatch.setenv(launch.FLUSH_ROWS_ENV, "16")
    assert launch.fp8_flush_rows(64, 1024) == 16 and launch.fp8_flush_rows_variants(64) == (16,)
    monkeypatch.setenv(launch.FLUSH_ROWS_ENV, "64")
    with pytest.raises(ValueError, match="REPLAYSSM_FLUSH_ROWS"):
        launch.fp8_flush_rows(64, 1024)


def test_fp8_read_hint_from_8192_row_heads(monkeypatch):
    """launch.fp8_read_hint: the FP8 warp kernel's read-copy loads with FP8_READ_HINT from
    heads x batch >= 8192 on; $REPLAYSSM_FP8_READ_HINT = 0 / 1 forces it and refuses
    anything else; the variants warmup / launch_padding cover; only the warp kernel (not
    the SIMT PDL variant) carries it, and the compile key tells the two apart."""
    from replayssm.kernels.cute import launch

    for env in (launch.FP8_READ_HINT_ENV, launch.FP8_DECODE_ENV, launch.PDL_KERNEL_ENV, launch.PDL_ENV):
        monkeypatch.delenv(env, raising=False)
    assert [launch.fp8_read_hint(16, b) for b in (1, 256, 511, 512, 1024)] == [False, False, False, True, True]
    assert [launch.fp8_read_hint(64, b) for b in (64, 127, 128, 256)] == [False, False, True, True]
    assert launch.fp8_read_hint_variants(16, False) == (False, True)
    assert launch.fp8_read_hint_variants(16, True) == (False,)
    assert launch.fp8_read_hint_variants(8192, False) == (True,)
    hinted = launch._kernel_object("decode_fp8", "sm_90a", 16, 2, "hw", read_hint=True)
    assert hinted.rc_hint == launch.FP8_READ_HINT
    assert launch._kernel_object("decode_fp8", "sm_90a", 16, 2, "hw").rc_hint == ""
    monkeypatch.setenv(launch.PDL_KERNEL_ENV, "simt")
    assert not launch._warp_kernel("decode_fp8", True) and launch._warp_kernel("decode_fp8", False)
    assert not hasattr(launch._kernel_object("decode_fp8", "sm_90a", 16, 2, "hw", pdl=True, read_hint=True), "rc_hint")
    monkeypatch.setenv(launch.FP8_READ_HINT_ENV, "1")
    assert launch.fp8_read_hint(16, 1) and launch.fp8_read_hint_variants(16, False) == (True,)
    monkeypatch.setenv(launch.FP8_READ_HINT_ENV, "0")
    assert not launch.fp8_read_hint(64, 1024) and launch.fp8_read_hint_variants(64, False) == (False,)
    monkeypatch.setenv(launch.FP8_READ_HINT_ENV, "yes")
    with pytest.raises(ValueError, match="REPLAYSSM_FP8_READ_HINT"):
        launch.fp8_read_hint(16, 1024)


@pytest.mark.parametrize("kind", ["flush_fp8", "flush_nvfp4"])
def test_the_flush_is_the_pdl_kernel_above_batch_1(monkeypatch, kind):
    """Above batch 1 the flush is launched with PDL (the non-flush kernel at batch 1,
    never both); $REPLAYSSM_FLUSH_PDL=0 or $REPLAYSSM_PDL=0 turns it off; the launchers
    build the PDL flush object (its wait: test_only_the_pdl_variants_wait_for_the_prepare_kernel)."""
    from replayssm.kernels.cute import launch, launch_nvfp4

    for env in (launch.PDL_ENV, launch.FLUSH_PDL_ENV, launch.FP8_DECODE_ENV):
        monkeypatch.delenv(env, raising=False)
    assert [launch.flush_pdl_for(b) for b in (1, 2, 256)] == [False, True, True]
    assert launch.pdl_variants(kind) == (False, True)
    assert launch.step_variants() == ((False, True), (True, False))
    assert [launch.pdl_pair(b, None, None) for b in (1, 2)] == [(True, False), (False, True)]
    assert launch.pdl_pair(256, False, False) == (False, False)
    with pytest.raises(ValueError, match="pdl and flush_pdl"):
        launch.pdl_pair(256, True, None)
    obj = (launch._kernel_object(kind, "sm_90a", 16, 2, "hw", True) if kind == "flush_fp8" else launch_nvfp4._kernel_object(kind, "sm_90a", 16, 2, True))
    assert obj.pdl is True
    monkeypatch.setenv(launch.FLUSH_PDL_ENV, "0")
    assert launch.flush_pdl_for(256) is False and launch.pdl_variants(kind) == (False,)
    assert launch.step_variants() == ((False, False), (True, False))
    monkeypatch.setenv(launch.FLUSH_PDL_ENV, "1")
    monkeypatch.setenv(launch.PDL_ENV, "0")
    assert launch.flush_pdl_for(256) is False and launch.pdl_variants(kind) == (False,)
    assert launch.step_variants() == ((False, False),)
    monkeypatch.setenv(launch.PDL_ENV, "1")
    monkeypatch.setenv(launch.FLUSH_PDL_ENV, "yes")
    with pytest.raises(ValueError, match="REPLAYSSM_FLUSH_PDL"):
        launch.flush_pdl()


def test_sass_stats_counts_the_kernels_structure(tmp_path, monkeypatch):
    """benchmarks/sass_stats.py (static SASS statistics, the offline proxy for the issue
    bound) reads the cubins right: the flush holds its 16 tensor-core MMAs a thread and
    4 barriers, the SIMT non-flush kernel no MMA and 2 barriers, the PDL variant differs
    from the plain SIMT one only by its wait (and so does the PDL flush from the plain
    flush), and the warp-per-head kernel has its 44 MMAs and no barrier."""
    import sys

    import cutlass.cute as cute

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import sass_stats
    from replayssm.kernels.cute import launch

    stats = {}
    runs = (
        ("flush", "flush_fp8", False, "warp"), ("nonflush", "decode_fp8", False, "simt"), ("pdl", "decode_fp8", True, "simt"),
        ("warp", "decode_fp8", False, "warp"), ("flush-pdl", "flush_fp8", True, "warp"),
    )
    for name, kind, pdl, mode in runs:
        sub = tmp_path / name
        sub.mkdir()
        monkeypatch.setenv(launch.FP8_DECODE_ENV, mode)
        obj = launch._kernel_object(kind, "sm_90a", 16, 2, "hw", pdl)
        cute.compile(obj, *launch._fake_args(kind), options=launch._options("sm_90a", sub))
        (cubin,) = [p for p in sub.iterdir() if p.suffix == ".cubin"]
        stats[name] = sass_stats.cubin_stats(cubin, sass_stats.default_cuobjdump())
    flush, nonflush, pdl, warp = (sass_stats.classify(stats[k]["ops"]) for k in ("flush", "nonflush", "pdl", "warp"))
    assert flush["MMA"] == FOLD_MMAS and flush["BAR"] == 4
    assert warp["MMA"] == WARP_F16_MMAS + WARP_BF16_MMAS and warp["BAR"] == 1  # the B_j . C partial sums
    assert nonflush["MMA"] == 0 and nonflush["BAR"] == 2
    assert stats["flush"]["regs"] <= 128 and stats["nonflush"]["regs"] <= 64  # 4 CTAs of 128 / 256 threads
    for a, b in (("pdl", "nonflush"), ("flush-pdl", "flush")):
        extra = stats[a]["ops"] - stats[b]["ops"]
        assert sum(extra.values()) == stats[a]["total"] - stats[b]["total"] == 1, (a, extra)
        assert sass_stats.classify(stats[a]["ops"]) == sass_stats.classify(stats[b]["ops"]), a


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])  # Triton's cuobjdump has no sm_103a (same code as sm_100a)
def test_flush_issues_a_rows_loads_before_its_staging(compiled, arch):
    """Every flush variant's SASS (both formats, every geometry) issues a flushed row's
    small loads (dt_j, dt, dt_bias, A, D: the 4-byte LDG.E; NVFP4: every load) before
    its first shared store, and no global load after the row's staging barrier. Loaded
    in the `t < 16` branch, dt_j went out only after the x_j / B_j shared stores had
    waited for their data, and D was loaded after the barrier that precedes the outputs:
    two round trips of their own in every flushed row's chain (docs/perf-notes-cute.md,
    session 11)."""
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import sass_stats

    cubins = [p for p in compiled[arch] if p.suffix == ".cubin" and p.parent.name.startswith("flush")]
    # 2 formats x 2 geometries x with and without PDL, and on sm_90a the FP8 flush's voted variants
    assert len(cubins) == (12 if arch == "sm_90a" else 8), [p.parent.name for p in cubins]
    for cubin in cubins:
        sass = subprocess.run([sass_stats.default_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
        bars = [i for i, op in enumerate(ops) if op.startswith("BAR")]
        # bars[0]: the flag ballot of a row group; bars[1]: a flushed row's staging barrier.
        row = ops[bars[0] + 1 : bars[1]]
        name = cubin.parent.name
        # The NVFP4 flush loads x_j / B_j from one source a thread (FlushFp8.stage_one_source):
        # those loads too come before its first shared store.
        loads = [i for i, op in enumerate(row) if op == "LDG.E" or (name.startswith("flush_nvfp4") and op.startswith("LDG"))]
        stores = [i for i, op in enumerate(row) if op.startswith("STS")]
        assert loads and stores and max(loads) < min(stores), (name, row)
        assert not [op for op in ops[bars[1] :] if op.startswith("LDG")], name


def test_traced_variants_read_the_clocks_and_the_others_do_not(compiled, monkeypatch, tmp_path):
    """benchmarks/cta_trace.py's traced variants (a trace buffer address baked in) read
    %globaltimer / %clock64 and store their records; the shipped variants (compile_all,
    address 0) contain none of it."""
    from replayssm.kernels.cute import decode_warp, flush_fp8, launch, launch_nvfp4

    for text in {**_ptx(compiled["sm_90a"], "decode"), **_ptx(compiled["sm_90a"], "flush")}.values():
        assert "%globaltimer" not in text and "%clock64" not in text
    monkeypatch.setattr(decode_warp._WarpHead, "trace_addr", 1 << 20)
    monkeypatch.setattr(flush_fp8.FlushFp8, "trace_addr", 1 << 21)
    paths = []
    for kind in ("decode_fp8", "flush_fp8"):
        obj = launch._kernel_object(kind, "sm_90a", 16, 2, "hw")
        paths += launch.compile_into(obj, launch._fake_args(kind), "sm_90a", tmp_path / kind)
    for kind in ("decode_nvfp4", "flush_nvfp4"):
        obj = launch_nvfp4._kernel_object(kind, "sm_90a", 16, 2)
        paths += launch.compile_into(obj, launch_nvfp4._fake_args(kind), "sm_90a", tmp_path / kind)
    texts = {p: Path(p).read_text() for p in paths if p.endswith(".ptx")}
    assert len(texts) == 4
    for p, text in texts.items():
        assert "%globaltimer" in text and "%clock64" in text and "%smid" in text, p
        assert "st.global.b64" in text, p
