"""Every developer task of the quant-fsdp monorepo: `nox -l` lists them.

Every session but `tests_latest` and `pins` installs the exact releases of constraints.txt, so a
fresh clone tests what its last change was tested with; `tests_latest` tests the newest releases
and `pins` rewrites constraints.txt from them (docs/development.md).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import zipfile

import nox
import tomllib

ROOT = pathlib.Path(__file__).parent
CONSTRAINTS = ROOT / "constraints.txt"
# Lowest layer first: installing in this order lets pip resolve each package's siblings locally.
PACKAGES = ("quant-core", "quant-tensors", "quant-fsdp", "quant-optim")
# The repository's lab (distribution quant-fsdp-lab, import quant_lab): the demo and the multi-process
# test worlds. Every session that installs the packages installs it too; `build` never builds it.
LAB = "lab"
LAB_DISTRIBUTION = "quant-fsdp-lab"
# torch's CPU build (the newer releases on the package index are CUDA builds of several GB).
TORCH = "torch==2.13.0"
# triton: its CPU interpreter checks the CUDA kernels' indexing and integer numerics on machines
# without a GPU (the tests/test_triton_*.py that are not marked cuda).
# build and the two backends (as in the packages' build-system.requires; pybind11 is needed only to
# compile): tests-integration/test_packaging.py builds each sdist without isolation.
# matplotlib (the lab's extra `plot`): the demo test checks the loss plot it draws.
# transformers: a sharded Hugging Face Llama must export to its plain class (test_export_llama.py).
# torchtitan (the extra quant-fsdp[torchtitan]; it imports triton) and torchao: test_torchtitan.py
# trains torchtitan's llama3 with the converter and refuses torchao's float8 converter beside it.
# accelerate: test_hf_accelerate.py runs Accelerate's own FSDP2 prepare on a converted Llama.
# pybind11 and twine: `tests` builds the wheels and sdists it installs without isolation, then
# checks them with `twine check` (`_build_dists`).
BUILD_DEPS = ("build>=1.2", "hatchling>=1.24", "scikit-build-core>=0.10", "pybind11>=2.13")
TEST_DEPS = (
    "pytest>=8", "hypothesis>=6.100", "numpy", "triton>=3.6", *BUILD_DEPS, "twine>=6",
    "matplotlib>=3.8", "transformers>=4.45", "torchtitan>=0.3", "torchao>=0.18", "accelerate>=1.16",
)  # fmt: skip
LINT_DEPS = ("ruff>=0.6", "import-linter>=2.1")
DOCS_DEPS = ("mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26")
# nox itself (.ci/run installs it from the pins) and what pip's isolated build of quant-core adds.
TOOL_DEPS = ("nox>=2024.4", "pybind11>=2.13")

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True


def _pin(session: nox.Session) -> None:
    """Every install of this session takes the releases of constraints.txt, pip's isolated build
    environments included (they read PIP_CONSTRAINT, not a `-c` given to the outer pip)."""
    session.env["PIP_CONSTRAINT"] = str(CONSTRAINTS)


def _install_packages(session: nox.Session, *extra: str) -> None:
    """torch first, then all four packages and the lab from the working tree."""
    session.install(TORCH)
    session.install(*(f"./packages/{p}" for p in PACKAGES), f"./{LAB}", *extra)


# What an installed copy of the packages and the lab is built from: every file of a package but its
# tests, notes and build outputs (the folders and suffixes .gitignore names).
_NOT_INSTALLED = {"tests", "build", "dist", "_skbuild", "__pycache__"}


def _sources_digest(*requirements: str) -> str:
    """sha256 over the requirements and the installed sources of the packages and the lab (paths and contents)."""
    digest = hashlib.sha256("\0".join((TORCH, CONSTRAINTS.read_text(), *requirements)).encode())
    for root in (*(ROOT / "packages" / p for p in PACKAGES), ROOT / LAB):
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root)
            if not path.is_file() or _NOT_INSTALLED.intersection(relative.parts) or path.suffix in (".so", ".pyc"):
                continue
            digest.update(f"{root.relative_to(ROOT).as_posix()}/{relative.as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _install_packages_once(session: nox.Session, *extra: str) -> None:
    """`_install_packages`, skipped when the session's environment already holds this very source
    tree and these requirements (a fresh machine installs; a second `nox -s demo` starts at once)."""
    stamp = pathlib.Path(session.virtualenv.location) / "quant-sources.sha256"
    digest = _sources_digest(*extra)
    if stamp.exists() and stamp.read_text() == digest:
        session.log("packages unchanged since the last install: installing nothing")
        return
    _install_packages(session, *extra)
    stamp.write_text(digest)


def _build_command(package: str, outdir: pathlib.Path, *, isolation: bool) -> list[str]:
    """`python -m build` of a package's sdist and wheel into `outdir`; `isolation=False` builds with
    the session's own backends (and reuses quant-core's CMake build folder, packages/quant-core/build/)."""
    flags = () if isolation else ("--no-isolation",)
    return ["python", "-m", "build", "--sdist", "--wheel", *flags, "--outdir", str(outdir), f"packages/{package}"]


class _BackgroundBuild:
    """A `_build_command` run in the session's environment, started when made, while the session
    goes on (quant-core's C++ build, ~1.5 min on 2 cores, beside the test dependencies' install)."""

    def __init__(self, session: nox.Session, command: list[str]) -> None:
        env = dict(os.environ)
        for name, value in session.env.items():  # as session.run: None unsets a variable
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        env["PATH"] = os.pathsep.join([str(session.bin), env.get("PATH", "")])
        session.log(f"{' '.join(command)} (in the background)")
        self._command = command
        self._process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def finish(self, session: nox.Session) -> None:
        """Waits for the build, prints its output, fails the session if the build failed."""
        output = self._process.communicate()[0].decode(errors="replace")
        print(output, end="", flush=True)
        if self._process.returncode:
            session.error(f"{' '.join(self._command)} failed with exit code {self._process.returncode}")


def _build_dists(
    session: nox.Session,
    outdir: pathlib.Path,
    *,
    isolation: bool,
    background: dict[str, _BackgroundBuild] | None = None,
) -> list[pathlib.Path]:
    """Builds each package's sdist and wheel from its folder into `outdir` (emptied first, unless
    `background` holds builds already writing there: those are waited for instead) and checks
    them: `twine check --strict` on every file, and quant-core's wheel must hold its compiled
    extension under a platform tag this interpreter installs (not `any`). Returns the wheels."""
    if background is None:
        shutil.rmtree(outdir, ignore_errors=True)
    for package in PACKAGES:
        if background and package in background:
            background[package].finish(session)
        else:
            session.run(*_build_command(package, outdir, isolation=isolation))
    session.run("twine", "check", "--strict", *sorted(map(str, outdir.iterdir())))
    wheels = sorted(outdir.glob("*.whl"))
    _check_extension_wheel(session, next(w for w in wheels if w.name.startswith("quant_core-")))
    return wheels


def _check_extension_wheel(session: nox.Session, wheel: pathlib.Path) -> None:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    tags = parse_wheel_filename(wheel.name)[3]
    if not tags & set(sys_tags()) or any(tag.platform == "any" for tag in tags):
        session.error(f"{wheel.name}: its tags {sorted(map(str, tags))} are not this platform's")
    with zipfile.ZipFile(wheel) as archive:
        extensions = [name for name in archive.namelist() if re.fullmatch(r"quant_core/_C\.[^/]+\.(so|pyd)", name)]
    if not extensions:
        session.error(f"{wheel.name} holds no compiled extension quant_core/_C.*")
    session.log(f"{wheel.name}: extension {extensions[0]}")


@nox.session
def tests(session: nox.Session) -> None:
    """Build and check the four packages' wheels and sdists, install the wheels, then run every
    package's unit tests, the lab's, tests-integration and benchmarks/tests."""
    _pin(session)
    session.install(*BUILD_DEPS)
    dist = pathlib.Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    core = _BackgroundBuild(session, _build_command("quant-core", dist, isolation=False))
    session.install(TORCH, *TEST_DEPS)
    wheels = [str(w) for w in _build_dists(session, dist, isolation=False, background={"quant-core": core})]
    # The wheels just built replace whatever an earlier run installed under the same version.
    session.install("--force-reinstall", "--no-deps", *wheels)
    session.install(*wheels, f"./{LAB}")
    unpinned = set(_third_party_releases(session)) - set(CONSTRAINTS.read_text().splitlines())
    if unpinned:
        session.error(f"installed but not pinned in {CONSTRAINTS.name}: {sorted(unpinned)}; run `nox -s pins`")
    session.run("pytest", *session.posargs)


@nox.session
def tests_latest(session: nox.Session) -> None:
    """`tests` with the newest release of every dependency instead of constraints.txt's."""
    _install_packages(session, "--upgrade", *TEST_DEPS)
    session.run("pytest", *session.posargs)


@nox.session
def pins(session: nox.Session) -> None:
    """Rewrite constraints.txt: the newest releases of what every session installs, resolved together."""
    _install_packages(session, "--upgrade", *TEST_DEPS, *LINT_DEPS, *DOCS_DEPS, *TOOL_DEPS)
    pins = sorted(_third_party_releases(session), key=str.lower)
    header = "# Every third-party release the nox sessions install (nox -s pins rewrites this file).\n"
    CONSTRAINTS.write_text(header + "\n".join(pins) + "\n")
    session.log(f"wrote {len(pins)} pins to {CONSTRAINTS.name}")


def _third_party_releases(session: nox.Session) -> list[str]:
    """`name==version` of every distribution in the session's environment but ours (the lab too) and pip."""
    from packaging.utils import canonicalize_name

    # --all keeps setuptools (a dependency of some of them); pip itself comes with the venv.
    frozen = session.run("python", "-m", "pip", "freeze", "--all", silent=True)
    ours = {*PACKAGES, LAB_DISTRIBUTION, "pip"}
    return [line for line in frozen.splitlines() if canonicalize_name(re.split("[ =@]", line)[0]) not in ours]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check and the import-linter layer contract."""
    _pin(session)
    session.install(*LINT_DEPS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    src_paths = os.pathsep.join([*(str(ROOT / "packages" / p / "src") for p in PACKAGES), str(ROOT / LAB / "src")])
    session.run("lint-imports", env={"PYTHONPATH": src_paths})


@nox.session
def build(session: nox.Session) -> None:
    """Build wheels and sdists of the four packages (not the lab) into dist/ in isolated build
    environments, check them (`_build_dists`), then install quant-fsdp[optim] from dist/ alone."""
    _pin(session)
    session.install("build>=1.2", "twine>=6")
    dist = ROOT / "dist"
    _build_dists(session, dist, isolation=True)
    check = session.create_tmp()
    venv_python = pathlib.Path(check) / "fresh" / "bin" / "python"
    session.run("python", "-m", "venv", str(venv_python.parent.parent), external=True)
    pip = (str(venv_python), "-m", "pip", "install", "-q", "--pre")
    session.run(*pip, TORCH, external=True)
    # Our four packages from dist/ alone (no index), then the extra's resolution, which may only
    # add third-party dependencies from the index since every quant-* requirement is now met.
    session.run(*pip, "--no-index", "--no-deps", "--find-links", str(dist), *PACKAGES, external=True)
    session.run(*pip, "--find-links", str(dist), "quant-fsdp[optim]", external=True)
    session.run(str(venv_python), "-m", "pip", "check", external=True)
    session.run(
        str(venv_python), "-c",
        "import quant_core, quant_tensors, quant_fsdp, quant_optim; "
        "print('installed from dist/:', quant_core.__version__, quant_tensors.__version__, "
        "quant_fsdp.__version__, quant_optim.__version__, 'backends', quant_core.available_backends())",
        external=True,
    )  # fmt: skip


@nox.session(venv_backend="none")
def check_versions(session: nox.Session) -> None:
    """Check that every inter-package version range admits the sibling's current version."""
    from packaging.requirements import Requirement

    versions = {}
    for package in PACKAGES:
        version_file = ROOT / "packages" / package / "src" / package.replace("-", "_") / "_version.py"
        namespace: dict[str, str] = {}
        exec(version_file.read_text(), namespace)
        versions[package] = namespace["__version__"]
    problems = []
    for package in PACKAGES:
        project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        for text in requirements:
            requirement = Requirement(text)
            if requirement.name in versions and not requirement.specifier.contains(
                versions[requirement.name], prereleases=True
            ):
                problems.append(f"{package} requires {text}, but {requirement.name} is at {versions[requirement.name]}")
            session.log(f"{package}: {text} (sibling at {versions.get(requirement.name, '-')})")
    if problems:
        session.error("; ".join(problems))


@nox.session
def docs(session: nox.Session) -> None:
    """Build the user docs (mkdocs-material, API pages by mkdocstrings) into site/; warnings are errors.

    mkdocstrings reads the sources of the four packages and the lab from packages/*/src and lab/src
    (mkdocs.yml `paths`), so nothing need be built or installed here.
    """
    _pin(session)
    session.install(*DOCS_DEPS)
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"), env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """Run the end-to-end demo (`quant-fsdp demo`, the lab's quant_lab.demo): tables, results/demo.json and
    results/demo_loss.png.

    Reuses its environment: the packages and the lab install again only when their sources or pins changed."""
    _pin(session)
    _install_packages_once(session, "matplotlib>=3.8")
    session.run("quant-fsdp", "demo", "--out", str(ROOT / "results"), *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Run the CPU benchmarks of benchmarks/: kernel_speed.py (kernels, FSDP2 hooks; posargs go to it),
    then optim.py (FusedAdam vs torch AdamW); tables, results/bench.json and results/bench_optim.json.
    The GPU benchmarks (linear_host.py, e2e.py, multi_gpu.py) run in scripts/gpu-suite.sh."""
    _pin(session)
    _install_packages_once(session)
    session.run(
        "python", str(ROOT / "benchmarks" / "kernel_speed.py"), "--out", str(ROOT / "results"), *session.posargs
    )
    session.run("python", str(ROOT / "benchmarks" / "optim.py"), "--out", str(ROOT / "results"))
