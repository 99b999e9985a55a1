"""Builds libeps (the Rust crate crates/eps-capi) with cargo and puts
libeps.so into the package, so `pip install ./python` needs only a Rust
toolchain. EPS_LIBRARY=/path/to/libeps.so installs that file instead."""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def say(line):
    """A line the user sees: pip shows a build's own output only with -v,
    so it goes to the terminal too when there is one."""
    print(line, flush=True)
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line + "\n")
    except OSError:
        pass


class BuildWithLibeps(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "eps" / "libeps.so"
        given = os.environ.get("EPS_LIBRARY")
        if given:
            src = Path(given)
        else:
            workspace = HERE.parent
            if not (workspace / "crates" / "eps-capi").is_dir():
                raise SystemExit("building libeps needs the EPS repository around python/ (or set EPS_LIBRARY)")
            cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
            say(
                "eps: building libeps with `cargo build --release -p eps-capi` (a minute or two on a small machine; "
                "`pip install -v` shows cargo's progress, EPS_LIBRARY=path/to/libeps.so skips the build)"
            )
            subprocess.check_call([cargo, "build", "--release", "--locked", "-p", "eps-capi"], cwd=workspace)
            target_dir = Path(os.environ.get("CARGO_TARGET_DIR", workspace / "target"))
            src = target_dir / "release" / "libeps.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)


setup(cmdclass={"build_py": BuildWithLibeps})
