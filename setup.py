"""Builds flash_cuda._C from csrc/ through torch.utils.cpp_extension (metadata: pyproject.toml).

Install with `pip install --no-build-isolation -e .` (or without -e): the extension binds to the
torch that is installed.  Knobs (environment):
  FLASH_CUDA_ARCHS            compute capabilities, e.g. "80;90"; else TORCH_CUDA_ARCH_LIST
                              (e.g. "8.0 9.0+PTX"); else the visible GPUs; else 80;90
  FLASH_CUDA_HDIMS            compiled head dims, e.g. "64;128" (default: all of csrc/manifest.py)
  FLASH_CUDA_DTYPES           "bf16;fp16" (default both)
  FLASH_CUDA_DISABLE_BACKWARD 1 to leave the backward kernels out
  FLASH_CUDA_DISABLE_KVCACHE  1 to leave the KV-cache kernels out
  FLASH_CUDA_DISABLE_CUDA     1 to build only the op layer (CPU reference, fake kernels); also
                              chosen when no nvcc is found or torch has no CUDA
  FLASH_CUDA_PTXAS_VERBOSE    1 to print registers / spills of every kernel
  CUTLASS_DIR                 CUTLASS checkout or include dir (else third_party/cutlass, else
                              the nvidia-cutlass package)
  CUDA_HOME                   the CUDA toolkit (its major version must be torch's)
  MAX_JOBS                    parallel compile jobs
"""

import functools
import importlib.util
import os
import sys
import time

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "csrc"))
import manifest  # noqa: E402  (csrc/manifest.py, the one list of compiled kernels)
import toolchain  # noqa: E402  (csrc/toolchain.py, compiler checks)


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
                       "third_party/cutlass"))
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.origin:
        candidates.append((os.path.join(os.path.dirname(spec.origin), "source", "include"),
                           "the nvidia-cutlass package"))
    for include, origin in candidates:
        if os.path.isfile(os.path.join(include, "cute", "tensor.hpp")):
            return include, origin
    raise RuntimeError(
        "flash_cuda: CUTLASS headers not found. Either `pip install nvidia-cutlass==4.2.0.0`, "
        "or put a CUTLASS 4.x checkout at third_party/cutlass, or set CUTLASS_DIR to one. "
        "Looked in: " + ", ".join(c[0] for c in candidates))


@functools.lru_cache(maxsize=None)
def detected_archs():
    try:
        import torch
        if torch.cuda.is_available():
            return tuple(sorted({10 * a + b for a, b in
                                 (torch.cuda.get_device_capability(i)
                                  for i in range(torch.cuda.device_count()))}))
    except Exception:  # a broken driver must not break a build for other archs
        pass
    return None


def nvcc_flags(gencode):
    """Every CUDA unit's flags, with the gencode flags of the portable family; the other
    families' units get their own gencode flags (toolchain.PerUnitFlags)."""
    flags = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
             "-DNDEBUG", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
             "-Xptxas=-warn-spills"] + gencode
    if os.environ.get("FLASH_CUDA_PTXAS_VERBOSE", "0") == "1":
        flags.append("-Xptxas=-v")
    return flags


# Host code: -g0 drops the debug info Python's own CFLAGS ask for, which doubles the op layer's
# compile time and is of no use in a release build.
CXX_FLAGS = ["-O3", "-std=c++17", "-g0"]


def include_dirs(cutlass_include):
    dirs = [os.path.join(ROOT, "csrc")]
    if cutlass_include:
        dirs.append(cutlass_include)
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


def _knob_on(name):
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def cuda_build_or_reason():
    """(nvcc, version) when the CUDA kernels can be built, else (None, why not)."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if _knob_on("FLASH_CUDA_DISABLE_CUDA"):
        return None, "FLASH_CUDA_DISABLE_CUDA is set"
    if torch.version.cuda is None:
        return None, f"this torch ({torch.__version__}) has no CUDA"
    found = toolchain.cuda_toolkit(CUDA_HOME)
    if found is None:
        return None, (f"no nvcc was found (CUDA_HOME={CUDA_HOME}); set CUDA_HOME to a CUDA "
                      f"{torch.version.cuda.split('.')[0]}.x toolkit to build the kernels")
    toolchain.check_cuda_versions(found[0], found[1], torch.version.cuda)
    return found, None


def extension_and_cmdclass():
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    nvcc, no_cuda_reason = cuda_build_or_reason()
    registration = ["csrc/ops/registration.cpp"]
    per_unit = toolchain.PerUnitFlags([], {})
    if nvcc is None:
        log(f"building without CUDA kernels: {no_cuda_reason}. The ops run on CPU tensors "
            "(the reference implementation) and trace under torch.compile; "
            "build_info()['devices'] is ['cpu'].")
        manifest.generate(os.path.join(ROOT, "csrc", "generated"), [], {})
        ext = CppExtension(name="flash_cuda._C", sources=registration,
                           include_dirs=include_dirs(None),
                           extra_compile_args={"cxx": CXX_FLAGS})
    else:
        archs, head_dims, dtypes, directions = manifest.parse_knobs(os.environ, detected_archs())
        _, arch_source = manifest.parse_archs(os.environ, detected_archs())
        selected = manifest.select(archs, head_dims, dtypes, directions)
        if not selected:
            raise RuntimeError(f"flash_cuda: no kernel family serves the archs {archs} (from "
                               f"{arch_source}); the portable family needs compute capability "
                               "80 or newer")
        # Only archs some family serves reach nvcc (sm_75 would reject cp.async).
        archs = sorted({a for family_archs, _ in selected.values() for a in family_archs})
        cutlass_include, origin = find_cutlass()
        log(f"using CUTLASS headers from {cutlass_include} ({origin})")
        log(f"{nvcc[0]} (CUDA {nvcc[1]}); archs {archs} (from {arch_source}), head dims "
            f"{list(head_dims)}, dtypes {list(dtypes)}, directions {list(directions)}")
        generated = manifest.generate(os.path.join(ROOT, "csrc", "generated"), archs, selected)
        kernel_sources = [os.path.relpath(p, ROOT) for paths in generated.values() for p in paths]
        sources = registration + ["csrc/ops/attention_cuda.cpp", "csrc/ops/kvcache_cuda.cpp",
                                  "csrc/dispatch/dispatch.cpp",
                                  "csrc/sm80/bwd_preprocess.cu",
                                  "csrc/common/combine.cu"] + kernel_sources
        portable = manifest.PORTABLE_FAMILY
        gencode = {f: manifest.gencode_flags(f, fa) for f, (fa, _) in selected.items()}
        for family, family_archs in sorted((f, fa) for f, (fa, _) in selected.items()):
            log(f"family {family}: {len(generated.get(family, []))} units for "
                f"{', '.join(manifest.targets(family, family_archs))}")
        per_unit = toolchain.PerUnitFlags(gencode[portable], {
            path: gencode[f] for f, paths in generated.items() if f != portable for path in paths})
        ext = CUDAExtension(
            name="flash_cuda._C",
            sources=sources,
            include_dirs=include_dirs(cutlass_include),
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": nvcc_flags(gencode[portable])},
        )

    class TimedBuild(BuildExtension):
        def run(self):
            # Before the compiler objects are made from CC / CXX; only when building, not for
            # the metadata steps that also import this file.
            toolchain.check_cxx_runtime(os.environ, log)
            super().run()

        def build_extensions(self):
            per_unit.check_backend(self.use_ninja)
            per_unit.install()
            start = time.time()
            super().build_extensions()
            per_unit.check_rewritten()
            report_compile_times(self.build_temp)
            log(f"extension built in {time.time() - start:.1f} s")

    return [ext], {"build_ext": TimedBuild.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_and_cmdclass()

# Metadata lives in pyproject.toml; setup.py adds only the extension.
setup(ext_modules=ext_modules, cmdclass=cmdclass)
