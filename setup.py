"""Builds flash_cuda._C from csrc/ with nvcc through torch.utils.cpp_extension.

Knobs (environment):
  FLASH_CUDA_ARCHS            e.g. "80;90" (default: the visible GPU, else 80;90)
  FLASH_CUDA_HDIMS            compiled head dims, e.g. "64;128" (default: all of csrc/manifest.py)
  FLASH_CUDA_DTYPES           "bf16;fp16" (default both)
  FLASH_CUDA_DISABLE_BACKWARD 1 to leave the backward kernels out
  FLASH_CUDA_PTXAS_VERBOSE    1 to print registers / spills of every kernel
  CUTLASS_DIR                 CUTLASS checkout or include dir (else third_party/cutlass, else
                              the nvidia-cutlass package)
  MAX_JOBS                    parallel compile jobs
"""

import importlib.util
import os
import sys
import time

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "csrc"))
import manifest  # noqa: E402  (csrc/manifest.py, the one list of compiled kernels)


def log(msg):
    print(f"flash_cuda: {msg}", flush=True)


def find_cutlass():
    """Returns (include_dir, where it came from) or raises with what to do."""
    candidates = []
    if os.environ.get("CUTLASS_DIR"):
        base = os.environ["CUTLASS_DIR"]
        candidates.append((os.path.join(base, "include"), "CUTLASS_DIR"))
        candidates.append((base, "CUTLASS_DIR"))
    candidates.append((os.path.join(ROOT, "third_party", "cutlass", "include"),
                       "third_party/cutlass submodule"))
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.origin:
        candidates.append((os.path.join(os.path.dirname(spec.origin), "source", "include"),
                           "the nvidia-cutlass package"))
    for include, origin in candidates:
        if os.path.isfile(os.path.join(include, "cute", "tensor.hpp")):
            return include, origin
    raise RuntimeError(
        "flash_cuda: CUTLASS headers not found. Either `pip install nvidia-cutlass==4.2.0.0`, "
        "or `git submodule update --init third_party/cutlass`, or set CUTLASS_DIR to a CUTLASS "
        "4.x checkout. Looked in: " + ", ".join(c[0] for c in candidates))


def detected_archs():
    try:
        import torch
        if torch.cuda.is_available():
            return sorted({10 * a + b for a, b in
                           (torch.cuda.get_device_capability(i)
                            for i in range(torch.cuda.device_count()))})
    except Exception:  # a broken driver must not break a build for other archs
        pass
    return None


def nvcc_flags(archs):
    flags = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
             "-DNDEBUG", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
             "-Xptxas=-warn-spills"]
    for arch in archs:
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    # PTX of the newest arch lets newer GPUs run the portable kernels too.
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    if os.environ.get("FLASH_CUDA_PTXAS_VERBOSE", "0") == "1":
        flags.append("-Xptxas=-v")
    return flags


def include_dirs(cutlass_include):
    dirs = [os.path.join(ROOT, "csrc"), cutlass_include]
    # Where only nvcc + cudart are installed, the CUDA library headers that ATen includes come
    # from torch's pip dependencies.
    for path in sys.path:
        candidate = os.path.join(path, "nvidia", "cu13", "include")
        if os.path.isdir(candidate):
            dirs.append(candidate)
            break
    return dirs


def report_compile_times(build_temp):
    """Prints how long each translation unit took, from ninja's log."""
    path = os.path.join(build_temp, ".ninja_log")
    if not os.path.exists(path):
        return
    times = {}
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 5 and parts[0].isdigit():
                times[parts[3]] = (int(parts[1]) - int(parts[0])) / 1000.0
    for output, seconds in sorted(times.items(), key=lambda kv: -kv[1]):
        log(f"compiled {os.path.basename(output)} in {seconds:.1f} s")


def extension_and_cmdclass():
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    archs, head_dims, dtypes, directions = manifest.parse_knobs(os.environ, detected_archs())
    selected = manifest.select(archs, head_dims, dtypes, directions)
    if not selected:
        raise RuntimeError(f"flash_cuda: no kernel family serves FLASH_CUDA_ARCHS={archs}; "
                           "the portable family needs compute capability 80 or newer")
    # Only archs some family serves reach nvcc (sm_75 would reject cp.async).
    archs = sorted({a for family_archs, _ in selected.values() for a in family_archs})
    cutlass_include, origin = find_cutlass()
    log(f"using CUTLASS headers from {cutlass_include} ({origin})")
    log(f"archs {archs}, head dims {list(head_dims)}, dtypes {list(dtypes)}, "
        f"directions {list(directions)}")
    generated = manifest.generate(os.path.join(ROOT, "csrc", "generated"), archs, selected)
    kernel_sources = [os.path.relpath(p, ROOT) for paths in generated.values() for p in paths]
    sources = ["csrc/ops/flash_api.cpp", "csrc/dispatch/dispatch.cpp",
               "csrc/sm80/bwd_preprocess.cu"] + kernel_sources
    ext = CUDAExtension(
        name="flash_cuda._C",
        sources=sources,
        include_dirs=include_dirs(cutlass_include),
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": nvcc_flags(archs)},
    )

    class TimedBuild(BuildExtension):
        def build_extensions(self):
            start = time.time()
            super().build_extensions()
            report_compile_times(self.build_temp)
            log(f"extension built in {time.time() - start:.1f} s")

    return [ext], {"build_ext": TimedBuild.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_and_cmdclass()

setup(
    name="flash_cuda",
    version="0.1.0",
    description="Exact attention kernels in CUDA with a FlashAttention-3-compatible API",
    packages=find_packages(include=["flash_cuda", "flash_cuda.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.9",
)
