"""The one declaration of which kernels flash_cuda compiles, and the generator that expands it.

setup.py filters the manifest with the build knobs (FLASH_CUDA_ARCHS or TORCH_CUDA_ARCH_LIST,
FLASH_CUDA_HDIMS, FLASH_CUDA_DTYPES, FLASH_CUDA_DISABLE_BACKWARD, FLASH_CUDA_DISABLE_KVCACHE) and calls `generate()`, which
writes one small translation unit per kernel, the dispatch tables the C++ dispatcher includes
(families, forward and backward kernels), and the build-info table that
`flash_cuda._C.build_info()` reports (and that the tests read).  Nothing
else in the project lists head dims, dtypes or archs.
"""

import dataclasses
import os

# Head dims with a compiled kernel.  Any other multiple of 8 up to 256 runs on the next size up
# (the kernels zero-fill the unused columns).
HEAD_DIMS = (64, 96, 128, 192, 256)
# manifest name -> (C++ element tag, dispatch enum)
DTYPES = {"fp16": ("half_t", "DType::kFloat16"), "bf16": ("bfloat16_t", "DType::kBFloat16")}
# Ops with kernels: the forward, the backward, and attention over a KV cache (fwd_kvcache: the
# append, rotary, split-KV attention and combine of flash_attn_with_kvcache, one launcher).
DIRECTIONS = ("fwd", "bwd", "fwd_kvcache")

# Kernel families, in preference order: dispatch takes the first compiled one that serves the GPU
# and supports the problem, and falls back to the portable family (the last) otherwise
# (FLASH_CUDA_FAMILY, read at run time, puts the family it names first).  Each family serves the
# compute capabilities [min_arch, max_arch), is compiled only for the archs of FLASH_CUDA_ARCHS
# in that range, and holds kernels for its `directions`.  `arch_specific` families compile to
# sm_XXa machine code and nothing else: code that uses wgmma or setmaxnreg runs on that arch
# only, so no PTX can carry it to a later GPU.
FAMILIES = {
    # TMA + wgmma + warp specialisation (csrc/sm90/); forward only: the backward of a Hopper
    # GPU runs on the portable family, fed by this family's out and lse.  Its KV-cache units
    # take chunked prefill (through a variant of its forward that reads cache rows and pages of
    # whole key tiles in place; other keys gathered into dense rows first); the rest runs on
    # sm80.
    "sm90": {"min_arch": 90, "max_arch": 100, "arch_enum": "kSm90", "arch_specific": True,
             "directions": ("fwd", "fwd_kvcache")},
    # mma.sync + cp.async: runs on every GPU from Ampere on (later ones through its PTX).
    "sm80": {"min_arch": 80, "max_arch": 1000, "arch_enum": "kSm80", "arch_specific": False,
             "directions": ("fwd", "bwd", "fwd_kvcache")},
}
PORTABLE_FAMILY = "sm80"
DEFAULT_ARCHS = (80, 90)



@dataclasses.dataclass(frozen=True)
class Kernel:
    family: str
    direction: str
    dtype: str
    head_dim: int

    @property
    def name(self):
        return f"{self.direction}_{self.family}_{self.dtype}_hdim{self.head_dim}"

    def _function(self, name):
        return f"flash_cuda::{self.family}::{name}<flash_cuda::{DTYPES[self.dtype][0]}, {self.head_dim}>"

    @property
    def launcher(self):
        return self._function(f"run_{self.direction}")

    @property
    def supports(self):
        """The function that says whether the kernel takes a problem (the forwards' only)."""
        return self._function(f"{self.direction}_supports") if self.direction != "bwd" else None

    @property
    def workspace(self):
        """The function that sizes the op's workspace (scratch device memory)."""
        return self._function(f"{self.direction}_workspace_bytes")


def _split(value):
    return [v for v in value.replace(",", ";").split(";") if v.strip()]


def _parse_arch(text, knob="FLASH_CUDA_ARCHS"):
    """'90', '90a', '9.0', '9.0a', '9.0+PTX' or 'sm_90' -> 90.  (+PTX changes nothing: the
    build always embeds PTX for its newest arch.)"""
    t = text.strip().lower().removeprefix("sm_").removeprefix("sm")
    t = t.removesuffix("+ptx").rstrip("af")
    try:
        return round(float(t) * 10) if "." in t else int(t)
    except ValueError:
        raise ValueError(f"{knob} entry {text!r} is not a compute capability "
                         f"(write e.g. {'8.0;9.0' if knob == 'TORCH_CUDA_ARCH_LIST' else '80;90'})"
                         ) from None


def parse_archs(env, detected_archs=None):
    """The archs to compile for, and which setting chose them.

    Precedence: FLASH_CUDA_ARCHS (e.g. "80;90"), then TORCH_CUDA_ARCH_LIST (PyTorch's knob,
    e.g. "8.0 9.0+PTX"), then the visible GPUs, then DEFAULT_ARCHS.
    """
    for knob in ("FLASH_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST"):
        if env.get(knob, "").strip():
            entries = env[knob].replace(" ", ";").replace(",", ";").split(";")
            return sorted({_parse_arch(a, knob) for a in entries if a.strip()}), knob
    if detected_archs:
        return sorted(set(detected_archs)), "the visible GPUs"
    return sorted(DEFAULT_ARCHS), "the default"


def parse_knobs(env, detected_archs=None):
    """Returns (archs, head_dims, dtypes, directions) selected by the environment."""
    archs, _ = parse_archs(env, detected_archs)
    head_dims = HEAD_DIMS
    if env.get("FLASH_CUDA_HDIMS"):
        head_dims = tuple(sorted({int(h) for h in _split(env["FLASH_CUDA_HDIMS"])}))
        unknown = set(head_dims) - set(HEAD_DIMS)
        if unknown:
            raise ValueError(f"FLASH_CUDA_HDIMS names {sorted(unknown)}, but the compiled head "
                             f"dims can only be chosen among {list(HEAD_DIMS)}")
    dtypes = tuple(DTYPES)
    if env.get("FLASH_CUDA_DTYPES"):
        dtypes = tuple(d.strip() for d in _split(env["FLASH_CUDA_DTYPES"]))
        unknown = set(dtypes) - set(DTYPES)
        if unknown:
            raise ValueError(f"FLASH_CUDA_DTYPES names {sorted(unknown)}; choose among "
                             f"{list(DTYPES)}")
    def disabled(knob):
        return env.get(knob, "0").strip().lower() not in ("", "0", "false", "no", "off")

    directions = tuple(d for d in DIRECTIONS
                       if not (d == "bwd" and disabled("FLASH_CUDA_DISABLE_BACKWARD"))
                       and not (d == "fwd_kvcache" and disabled("FLASH_CUDA_DISABLE_KVCACHE")))
    return archs, head_dims, dtypes, directions


def select(archs, head_dims, dtypes, directions):
    """Returns {family: (family_archs, [Kernel, ...])} for the families some arch needs."""
    selected = {}
    for family, info in FAMILIES.items():
        family_archs = [a for a in archs if info["min_arch"] <= a < info["max_arch"]]
        if not family_archs:
            continue
        kernels = [Kernel(family, direction, dtype, hdim)
                   for direction in directions if direction in info["directions"]
                   for dtype in dtypes for hdim in head_dims]
        selected[family] = (family_archs, kernels)
    return selected


def gencode_flags(family, family_archs):
    """nvcc's -gencode flags for a family's units: machine code for each arch, and PTX of the
    newest for later GPUs unless the family is arch-specific."""
    if FAMILIES[family]["arch_specific"]:
        return [f"-gencode=arch=compute_{a}a,code=sm_{a}a" for a in family_archs]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in family_archs]
    newest = family_archs[-1]
    return flags + [f"-gencode=arch=compute_{newest},code=compute_{newest}"]


def targets(family, family_archs):
    """What a family's units are compiled to, as build_info() reports it: sm_90a, compute_90..."""
    return [f.rsplit("code=", 1)[1] for f in gencode_flags(family, family_archs)]


def _write_if_changed(path, text):
    """Keeps mtimes stable so that an unchanged kernel file is not rebuilt."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def _kernel_source(kernel):
    lines = ["// Generated from csrc/manifest.py: one instantiation per translation unit so that",
             "// kernels compile in parallel.",
             f'#include "{kernel.family}/launch_{kernel.direction}.cuh"', ""]
    if kernel.direction != "bwd":
        params = {"fwd": "FwdParams", "fwd_kvcache": "KvcacheParams"}[kernel.direction]
        lines.append(f"template bool {kernel.supports}(const flash_cuda::{params}&);")
        lines.append(f"template size_t {kernel.workspace}(const flash_cuda::{params}&);")
        lines.append(f"template cudaError_t {kernel.launcher}(const flash_cuda::{params}&, "
                     f"void*, cudaStream_t);")
        if kernel.direction == "fwd_kvcache":
            lines.append(f"template int {kernel._function('fwd_kvcache_num_splits')}"
                         f"(const flash_cuda::{params}&);")
    else:
        lines.append(f"template size_t {kernel.workspace}(const flash_cuda::BwdParams&);")
        lines.append(f"template cudaError_t {kernel.launcher}(const flash_cuda::BwdParams&, "
                     f"void*, cudaStream_t);")
    return "\n".join(lines) + "\n"


def _dtype_enum(dtype):
    return DTYPES[dtype][1].split("::")[1]


def _table_sources(selected):
    """{file name: text}: the families, the forward kernels and the backward kernels."""
    head = "// Generated from csrc/manifest.py: "
    families = [head + "the kernel families this build holds, in preference order.",
                "// FLASH_CUDA_FAMILY(enum, name, min_arch, end_arch, arch_specific, compiled archs...)"]
    fwd = [head + "the forward kernels.",
           "// FLASH_CUDA_FWD_KERNEL(family, dtype, head_dim, supports, workspace_bytes, run)"]
    bwd = [head + "the backward kernels.",
           "// FLASH_CUDA_BWD_KERNEL(family, dtype, head_dim, workspace_bytes, run)"]
    kvcache = [head + "the KV-cache kernels.",
               "// FLASH_CUDA_FWD_KVCACHE_KERNEL(family, dtype, head_dim, supports, "
               "workspace_bytes, run, num_splits)"]
    for family, (archs, kernels) in selected.items():
        info = FAMILIES[family]
        families.append(f'FLASH_CUDA_FAMILY({info["arch_enum"]}, "{family}", {info["min_arch"]}, '
                        f'{info["max_arch"]}, {str(info["arch_specific"]).lower()}, '
                        f'{", ".join(str(a) for a in archs)})')
        for k in kernels:
            key = f"{info['arch_enum']}, {_dtype_enum(k.dtype)}, {k.head_dim}"
            if k.direction == "fwd":
                fwd.append(f"FLASH_CUDA_FWD_KERNEL({key}, ({k.supports}), ({k.workspace}), "
                           f"({k.launcher}))")
            elif k.direction == "fwd_kvcache":
                kvcache.append(f"FLASH_CUDA_FWD_KVCACHE_KERNEL({key}, ({k.supports}), "
                               f"({k.workspace}), ({k.launcher}), "
                               f"({k._function('fwd_kvcache_num_splits')}))")
            else:
                bwd.append(f"FLASH_CUDA_BWD_KERNEL({key}, ({k.workspace}), ({k.launcher}))")
    return {"family_table.inc": families, "fwd_kernel_table.inc": fwd,
            "bwd_kernel_table.inc": bwd, "fwd_kvcache_kernel_table.inc": kvcache}


def _build_info_source(archs, selected):
    """FLASH_CUDA_BUILD_ARCHS {a, ...} and FLASH_CUDA_BUILD_KERNELS {{name, direction, family,
    dtype, head_dim}, ...}; both empty in a build without CUDA kernels."""
    kernels = [k for _, (_, ks) in selected.items() for k in ks]
    lines = ["// Generated from csrc/manifest.py: what this build holds, for build_info().",
             f"#define FLASH_CUDA_BUILD_ARCHS {{{', '.join(str(a) for a in archs)}}}",
             "#define FLASH_CUDA_BUILD_KERNELS {" + (" \\" if kernels else "}")]
    for k in kernels:
        lines.append(f'  {{"{k.name}", "{k.direction}", "{k.family}", "{k.dtype}", '
                     f"{k.head_dim}}}, \\")
    if kernels:
        lines.append("}")
    # {name, targets, min_arch, end_arch, ops}: the families in preference order.
    lines.append("#define FLASH_CUDA_BUILD_FAMILIES {" + (" \\" if selected else "}"))
    for family, (fa, ks) in selected.items():
        info = FAMILIES[family]
        ops = sorted({k.direction for k in ks}, key=DIRECTIONS.index)
        lines.append(f'  {{"{family}", "{" ".join(targets(family, fa))}", {info["min_arch"]}, '
                     f'{info["max_arch"]}, "{" ".join(ops)}"}}, \\')
    if selected:
        lines.append("}")
    return "\n".join(lines) + "\n"


def generate(out_dir, archs, selected):
    """Writes the kernel translation units and the tables; returns {family: [paths]}."""
    os.makedirs(out_dir, exist_ok=True)
    sources = {}
    for family, (_, kernels) in selected.items():
        for k in kernels:
            path = os.path.join(out_dir, f"{k.name}.cu")
            _write_if_changed(path, _kernel_source(k))
            sources.setdefault(family, []).append(path)
    for name, lines in _table_sources(selected).items():
        _write_if_changed(os.path.join(out_dir, name), "\n".join(lines) + "\n")
    _write_if_changed(os.path.join(out_dir, "build_info.inc"), _build_info_source(archs, selected))
    return sources
