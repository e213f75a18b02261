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
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_dir = target.parent
        prebuilt = os.environ.get("TERRA_PREBUILT_EXTENSION")
        if prebuilt:
            # scripts/setup.sh has already built it with CMake; pip only registers the package.
            out_dir.mkdir(parents=True, exist_ok=True)
            if Path(prebuilt).resolve() != target:
                shutil.copyfile(prebuilt, target)
            return
        # A build folder of its own: scripts/setup.sh's build/ writes into the source tree.
        build_dir = Path(os.environ.get("TERRA_BUILD_DIR", ROOT / "build" / "pip"))
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
