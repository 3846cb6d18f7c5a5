"""Build-time checks of the compilers setup.py hands to torch's extension builder, and the
per-family nvcc flags it adds to torch's ninja file (PerUnitFlags).

Two checks, both run before anything is compiled, so that a bad toolchain fails the build with
a message instead of producing an extension that misbehaves at run time:

* `check_cxx_runtime`: the C++ compiler must link the extension against the C++ runtime that
  torch and the interpreter already use (Note [One C++ runtime]).
* `cuda_toolkit` / `check_cuda_versions`: nvcc's CUDA major version must be torch's.

Plain Python with no torch import at module level; tests load it like csrc/manifest.py.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile

# Note [One C++ runtime]
# A C++ compiler that is not the system's (seen: CXX=/opt/gcc/bin/g++ on a CUDA image whose
# torch and Python use /usr/lib/x86_64-linux-gnu/libstdc++.so.6) can link parts of its own
# libstdc++ into every shared library it builds. The extension then carries private copies of
# functions such as std::ostream::_M_insert<double> that run against stream and locale objects of
# the process's libstdc++: formatting a number into a c10::str / TORCH_CHECK message crashed the
# process with SIGSEGV there, and with `g++ -static-libstdc++` here it silently printed nothing.
# The probe below builds a tiny shared library the way the extension is linked, loads it into a
# Python that has imported torch, and checks that it formats numbers; a compiler that fails is
# replaced by the system compiler when that one passes, and the build stops otherwise.

_PROBE_SOURCE = r"""
#include <cstring>
#include <sstream>
#include <string>
extern "C" int flash_cuda_probe(double x, char* out, int n) {
  std::ostringstream s;
  s << "got " << x << " and " << 42L;
  const std::string r = s.str();
  std::strncpy(out, r.c_str(), n - 1);
  out[n - 1] = 0;
  return static_cast<int>(r.size());
}
"""
_PROBE_EXPECTED = "got 0.5 and 42"
_PROBE_RUN = (
    "import ctypes, sys, torch\n"
    "lib = ctypes.CDLL(sys.argv[1])\n"
    "buf = ctypes.create_string_buffer(64)\n"
    "lib.flash_cuda_probe(ctypes.c_double(0.5), buf, 64)\n"
    "print(buf.value.decode())\n")


def _link_flags():
    """The flags after the compiler in Python's LDSHARED (e.g. -shared -Wl,-O1
    -Wl,-Bsymbolic-functions): setuptools links extensions with them."""
    ldshared = (sysconfig.get_config_var("LDSHARED") or "").split()
    flags = [f for f in ldshared[1:] if f.startswith(("-Wl,", "-shared", "-pthread"))]
    return flags if "-shared" in flags else ["-shared"] + flags


def probe_cxx(cxx, python=sys.executable):
    """(ok, detail): whether `cxx` links a shared library that formats numbers correctly when
    loaded beside torch. `cxx` is a command (a path or a name on PATH, possibly with a wrapper
    such as ccache or flags, split as a shell would)."""
    with tempfile.TemporaryDirectory(prefix="flash_cuda_probe_") as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE_SOURCE)
        cmd = shlex.split(cxx) + ["-fPIC", "-O2", src, "-o", lib] + _link_flags()
        try:
            built = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"it could not be run: {exc}"
        if built.returncode != 0:
            return False, f"it could not build a shared library: {built.stderr.strip()[-500:]}"
        ran = subprocess.run([python, "-c", _PROBE_RUN, lib], capture_output=True, text=True,
                             timeout=300)
        output = ran.stdout.strip()
        if ran.returncode == 0 and output == _PROBE_EXPECTED:
            return True, "ok"
        how = (f"the process died with signal {-ran.returncode}" if ran.returncode < 0 else
               f"it printed {output!r} instead of {_PROBE_EXPECTED!r}" if ran.returncode == 0
               else f"it failed: {ran.stderr.strip()[-300:]}")
        return False, f"a library it linked formats numbers wrongly beside torch: {how}"


def _sibling_c_compiler(cxx_path):
    """gcc for g++, clang for clang++, cc for c++, in the same directory."""
    folder, name = os.path.split(cxx_path)
    for pattern, repl in (("g++", "gcc"), ("clang++", "clang"), ("c++", "cc")):
        if name.endswith(pattern):
            candidate = os.path.join(folder, name[: -len(pattern)] + repl)
            if os.path.exists(candidate):
                return candidate
    return None


def _fallback_compilers():
    """The system compilers to try instead: on PATH, and where a distribution puts them (a
    foreign toolchain may come first on PATH)."""
    found = [shutil.which(name) for name in ("c++", "g++")]
    found += [p for p in ("/usr/bin/c++", "/usr/bin/g++") if os.path.exists(p)]
    unique, seen = [], set()
    for path in found:
        if path and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            unique.append(path)
    return unique


def check_cxx_runtime(env, log, python=sys.executable):
    """Makes env['CXX'] a compiler that passes probe_cxx (and env['CC'], which nvcc uses as its
    host compiler, its sibling, when CXX has to be replaced); returns the C++ compiler in use.
    Raises RuntimeError if none passes. A CC beside a passing CXX is left alone: nvcc only
    compiles with it, and the link, where a runtime gets copied in, is CXX's."""
    chosen = env.get("CXX") or "c++"
    ok, detail = probe_cxx(chosen, python)
    if ok:
        return chosen
    tried = [f"{chosen}: {detail}"]
    first = shutil.which(shlex.split(chosen)[0]) if chosen.strip() else None
    for path in _fallback_compilers():
        if first and os.path.realpath(path) == os.path.realpath(first):
            continue
        ok, fallback_detail = probe_cxx(path, python)
        if ok:
            why = ("links its own copy of the C++ runtime into shared libraries"
                   if "formats numbers wrongly" in detail else "cannot build the extension")
            log(f"WARNING: CXX={chosen} {why} ({detail}); building with {path} instead, which "
                f"links the runtime torch uses (Note [One C++ runtime] in csrc/toolchain.py)")
            env["CXX"] = path
            cc = _sibling_c_compiler(path)
            if cc:
                env["CC"] = cc
            else:
                env.pop("CC", None)
            return path
        tried.append(f"{path}: {fallback_detail}")
    raise RuntimeError(
        "flash_cuda: no C++ compiler here links extensions against the C++ runtime that torch "
        "uses, so the extension would crash or print wrong numbers in its error messages "
        "(Note [One C++ runtime] in csrc/toolchain.py). Tried: " + "; ".join(tried) +
        ". Point CXX and CC at the system compiler (e.g. /usr/bin/g++ and /usr/bin/gcc).")


def cuda_toolkit(cuda_home):
    """(nvcc path, 'major.minor') of the toolkit at cuda_home, or None when it has no nvcc."""
    if not cuda_home:
        return None
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release (\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"flash_cuda: could not read the CUDA version from `{nvcc} --version` "
                           f"(it printed {out.strip()[-200:]!r}); set CUDA_HOME to a working "
                           f"CUDA toolkit, or build without CUDA kernels with "
                           f"FLASH_CUDA_DISABLE_CUDA=1.")
    return nvcc, f"{match.group(1)}.{match.group(2)}"


def check_cuda_versions(nvcc, nvcc_version, torch_cuda):
    """torch's CUDA build and nvcc must share the major version (their runtimes and headers
    differ across majors)."""
    if nvcc_version.split(".")[0] != str(torch_cuda).split(".")[0]:
        raise RuntimeError(
            f"flash_cuda: {nvcc} is CUDA {nvcc_version}, but this torch was built for CUDA "
            f"{torch_cuda}; the extension must be compiled with a CUDA {torch_cuda.split('.')[0]}"
            f".x toolkit. Point CUDA_HOME at one (e.g. CUDA_HOME=/usr/local/cuda-"
            f"{torch_cuda}), install the torch build for CUDA {nvcc_version.split('.')[0]}, or "
            f"build without CUDA kernels with FLASH_CUDA_DISABLE_CUDA=1.")


class PerUnitFlags:
    """Gives each family's units their own -gencode flags.

    torch's BuildExtension compiles every .cu of an extension with one flag list, but an sm_90a
    unit must not be compiled for sm_80 (its wgmma does not exist there) nor a portable unit for
    sm_90a only.  So the extension's flags carry the portable family's gencode flags, and once
    torch has written build.ninja, each other family's build statements get a
    `cuda_post_cflags` binding of their own (ninja lets a build statement shadow a file-level
    variable) with that family's gencode flags in place of the portable ones.  Only torch's
    ninja backend writes that file: `check_rewritten` fails the build when units that need their
    own flags were compiled without the rewrite (torch falls back to its distutils backend,
    silently, when no ninja is on PATH).
    """

    PREFIX = "cuda_post_cflags = "

    def __init__(self, default_gencode, overrides):
        self.default = " ".join(default_gencode)
        self.overrides = {os.path.realpath(src): " ".join(flags)
                          for src, flags in overrides.items()}
        self.rewritten = False

    def rewrite(self, path):
        with open(path) as f:
            lines = f.read().splitlines()
        value = next((l[len(self.PREFIX):] for l in lines if l.startswith(self.PREFIX)), None)
        if value is None or self.default not in value:
            raise RuntimeError(f"flash_cuda: {path} has no cuda_post_cflags with the portable "
                               f"gencode flags; this torch writes its ninja file differently")
        out, found, overridden = [], 0, False
        for line in lines:
            # A binding torch itself gave an overridden build statement would shadow ours.
            if overridden and line.startswith("  " + self.PREFIX):
                continue
            overridden = False
            out.append(line)
            head, sep, src = line.partition(": cuda_compile ")
            if line.startswith("build ") and sep:
                flags = self.overrides.get(os.path.realpath(src.replace("$ ", " ")))
                if flags is not None:
                    out.append("  " + self.PREFIX + value.replace(self.default, flags))
                    found += 1
                    overridden = True
        if found != len(self.overrides):
            raise RuntimeError(f"flash_cuda: found {found} of the {len(self.overrides)} units "
                               f"with their own flags in {path}")
        with open(path, "w") as f:
            f.write("\n".join(out) + "\n")
        self.rewritten = True

    def install(self):
        """Wraps torch's ninja writer (a private function: checked to exist, so that a torch
        without it fails the build loudly rather than compiling units for the wrong archs)."""
        if not self.overrides:
            return
        from torch.utils import cpp_extension
        write = getattr(cpp_extension, "_write_ninja_file", None)
        if write is None:
            raise RuntimeError("flash_cuda: torch.utils.cpp_extension._write_ninja_file is gone; "
                               "csrc/toolchain.py's PerUnitFlags must follow torch's ninja writer")

        def write_and_rewrite(path, *args, **kwargs):
            write(path, *args, **kwargs)
            self.rewrite(path)

        cpp_extension._write_ninja_file = write_and_rewrite

    def check_backend(self, use_ninja):
        """Before compiling: units with their own flags need torch's ninja backend."""
        if self.overrides and not use_ninja:
            raise RuntimeError(
                "flash_cuda: the sm90 units need their own -gencode flags, which only torch's "
                "ninja backend can give them, and this build runs without ninja (torch uses it "
                "only when `ninja --version` runs: pip install ninja, and put it on PATH)")

    def check_rewritten(self):
        """After compiling: the ninja file was rewritten (else units got the wrong flags)."""
        if self.overrides and not self.rewritten:
            raise RuntimeError("flash_cuda: the units with their own -gencode flags were "
                               "compiled without them (torch's ninja file was never written)")
