"""CuTe DSL kernels, one kernel family for every format: the decode step (`decode.Decode`,
non-flush; `flush.Flush`, the flush), pending mode's (`pending`), initialize and clear
(`bookkeeping`), the plan kernels (`plan`), with the format strategies of `read_copy`, the
argument structs of `args`, the launch variants of `config`, the compile cache and launcher of
`launch` and the arch table of `arch`. Importing this package does not import the CuTe DSL.
"""

from .arch import ARCH_ENV, ARCHS, SUPPORTED, arch_for, check_arch

__all__ = ["ARCH_ENV", "ARCHS", "SUPPORTED", "arch_for", "check_arch"]
