"""Drives CMakeLists.txt so that `pip install -e . --no-build-isolation` builds terra_torch._C
against the torch in the current environment. Metadata lives in pyproject.toml."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        if self.inplace or getattr(self, "editable_mode", False):
            out_dir = ROOT / "terra_torch"  # editable: the source tree is the package
        build_dir = Path(os.environ.get("TERRA_BUILD_DIR", ROOT / "build"))
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DTERRA_OUTPUT_DIR={out_dir}",
            f"-DTERRA_WITH_CUDA={os.environ.get('TERRA_WITH_CUDA', 'AUTO')}",
        ]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        subprocess.check_call(configure)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs])


setup(ext_modules=[CMakeExtension("terra_torch._C")], cmdclass={"build_ext": CMakeBuild})
