"""Every package's sdist holds sources only, whatever build outputs lie in the checkout; quant-fsdp's
wheel holds the library and its command line, not the repository's lab (lab/: the demo and the
multi-process test worlds).

Each package is copied (sources only) into a tmp monorepo, with the root .gitignore above it or
without (a package's own build configuration must keep build outputs out either way), the kinds of
junk a developer's checkout holds are planted there (a CMake build tree, an in-place extension,
bytecode, egg-info, an old dist/), and the sdist is built from it without build isolation: the
backends (hatchling, scikit-build-core) come from the test environment, and no C++ is compiled.
"""

from __future__ import annotations

import pathlib
import shutil
import tarfile
import zipfile

import pytest
from build import ProjectBuilder

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("quant-core", "quant-tensors", "quant-fsdp", "quant-optim")
# Allowed members, as paths inside the sdist's top folder (engineer notes, NOTES.md, stay out): these files at the top (.gitignore is
# the monorepo's, which hatchling ships so a build from the sdist drops the same files)...
TOP_LEVEL_FILES = {
    "PKG-INFO",
    "pyproject.toml",
    "README.md",
    "CHANGELOG.md",
    ".gitignore",
    "CMakeLists.txt",
}
# ...and, below these folders, files with these suffixes.
SOURCE_FOLDERS = {"csrc", "src", "tests"}
SOURCE_SUFFIXES = {".py", ".pyi", ".typed", ".cpp", ".h"}
# What a used checkout holds and an sdist must not: copying skips it, planting adds it back.
JUNK_NAMES = (
    "build",
    "dist",
    "_skbuild",
    "__pycache__",
    "*.egg-info",
    "*.so",
    "*.o",
    "*.pyc",
    ".*_cache",
    ".hypothesis",
)


def _module(package: str) -> str:
    return package.replace("-", "_")


def _plant_junk(package_dir: pathlib.Path, module: str) -> None:
    """Build outputs where a developer's checkout has them (an sdist once shipped one)."""
    junk = (
        "build/cp311-cp311-linux_x86_64/CMakeFiles/_C.dir/csrc/adam.cpp.o",
        "build/junk.o",
        "csrc/build/CMakeFiles/module.cpp.o",
        "dist/old-0.0.1.tar.gz",
        f"src/{module}/_C.cpython-311-x86_64-linux-gnu.so",
        f"src/{module}/__pycache__/__init__.cpython-311.pyc",
        f"src/{module}.egg-info/PKG-INFO",
        "tests/__pycache__/test_package.cpython-311-pytest-9.2.0.pyc",
    )
    for relative in junk:
        path = package_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0junk")


def _is_source(member: str) -> bool:
    parts = pathlib.PurePosixPath(member).parts
    if len(parts) == 1:
        return parts[0] in TOP_LEVEL_FILES
    return parts[0] in SOURCE_FOLDERS and pathlib.PurePosixPath(member).suffix in SOURCE_SUFFIXES


@pytest.mark.parametrize("gitignore", [True, False], ids=["monorepo-gitignore", "no-gitignore"])
@pytest.mark.parametrize("package", PACKAGES)
def test_sdist_holds_sources_only(package: str, gitignore: bool, tmp_path: pathlib.Path) -> None:
    source = ROOT / "packages" / package
    module = _module(package)
    repo = tmp_path / "repo"
    copy = repo / "packages" / package
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(*JUNK_NAMES))
    if gitignore:
        shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    _plant_junk(copy, module)

    sdist = pathlib.Path(ProjectBuilder(copy).build("sdist", tmp_path / "dist"))
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    top = f"{module}-"
    assert all(name.startswith(top) for name in names), names
    members = {name.split("/", 1)[1] for name in names if "/" in name}

    assert sorted(m for m in members if not _is_source(m)) == []
    expected = {"PKG-INFO", "pyproject.toml", "README.md", f"src/{module}/__init__.py", f"src/{module}/py.typed"}
    expected |= {p.relative_to(source).as_posix() for p in (source / "src").rglob("*.py")}
    expected |= {p.relative_to(source).as_posix() for p in (source / "tests").glob("*.py")}
    if package == "quant-core":
        expected |= {"CMakeLists.txt", "src/quant_core/_C.pyi"}
        expected |= {p.relative_to(source).as_posix() for p in (source / "csrc").glob("*.[ch]*")}
    assert sorted(expected - members) == []


def test_quant_fsdp_wheel_holds_no_demo_or_testing_module(tmp_path: pathlib.Path) -> None:
    source = ROOT / "packages" / "quant-fsdp"
    repo = tmp_path / "repo"
    copy = repo / "packages" / "quant-fsdp"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(*JUNK_NAMES))
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")

    wheel = pathlib.Path(ProjectBuilder(copy).build("wheel", tmp_path / "dist"))
    with zipfile.ZipFile(wheel) as archive:
        modules = [pathlib.PurePosixPath(name) for name in archive.namelist() if name.endswith(".py")]
    assert pathlib.PurePosixPath("quant_fsdp/__init__.py") in modules
    assert pathlib.PurePosixPath("quant_fsdp_cli.py") in modules
    lab = [str(m) for m in modules if {"demo", "testing"} & {m.stem, *m.parts[:-1]}]
    assert lab == [], f"the lab's modules belong in lab/, not in the published wheel: {lab}"
