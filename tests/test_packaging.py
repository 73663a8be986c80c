"""`kernels/` installs as `attnperf.kernels`, never as a top-level `kernels` module; the
import has no side effects but a warning for an untested torch."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from attnperf.version import torch_warning, warn_on_untested_torch

REPO = Path(__file__).resolve().parents[1]
PROBE = "import attnperf.kernels.reference as m, importlib.util as u; print(m.__file__); " \
    "s = u.find_spec('kernels'); print(s and s.origin)"  # fmt: skip


def test_installed_package_imports_attnperf_kernels_from_outside_the_repo(tmp_path):
    """A top-level `kernels` is never ours (it may be another package: HF's `kernels`, which
    transformers 5.25 requires)."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    module_file, kernels_origin = result.stdout.splitlines()
    assert Path(module_file).parent.name == "kernels"
    assert kernels_origin == "None" or Path(kernels_origin).parent != REPO / "kernels"


def test_wheel_maps_kernels_under_attnperf(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "dist"), str(REPO)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("attnperf-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "attnperf/kernels/reference.py" in names
    assert not [name for name in names if name.startswith("kernels/")]
    # Every module of the tree, the kernel packages' too (a package left out of pyproject's
    # list would be missing from a regular install only).
    sources = {
        f"attnperf/kernels/{path.relative_to(REPO / 'kernels').as_posix()}"
        for path in (REPO / "kernels").rglob("*.py")
    } | {path.relative_to(REPO).as_posix() for path in (REPO / "attnperf").rglob("*.py")}
    assert sorted(sources - set(names)) == []
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    result = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path[:0] = [{str(site)!r}] + "
         f"{[p for p in sys.path if 'site-packages' in p]!r}; {PROBE}"],
        capture_output=True, text=True, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert result.stdout.splitlines()[0].startswith(str(site))


def test_import_has_no_side_effects(tmp_path):
    """`import attnperf` loads no optional dependency, compiles nothing, probes no device."""
    optional = ("numba", "triton", "transformers", "scipy")
    probe = (
        "import sys, attnperf, torch; "
        f"print(sorted(m for m in {optional} if m in sys.modules)); "
        "print(torch.cuda.is_initialized())"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    assert result.stdout.split("\n")[:2] == ["[]", "False"]


@pytest.mark.parametrize(
    "version, tested", [("2.13.0+cpu", True), ("2.14.1", True), ("2.15.0+cu132", True),
                        ("2.12.1", False), ("2.16.0", False), ("3.0.0", False)],
)  # fmt: skip
def test_a_torch_outside_the_tested_range_is_named_in_a_warning(version, tested):
    reason = torch_warning(version)
    assert (reason is None) == tested
    if not tested:
        assert f"torch {version} may work, but is not tested" in reason
        with pytest.warns(UserWarning, match="is tested with torch 2.13, 2.14, 2.15"):
            warn_on_untested_torch(version)


def test_the_torch_under_test_imports_without_a_warning(tmp_path):
    result = subprocess.run([sys.executable, "-W", "error", "-c", "import attnperf"],
                            capture_output=True, text=True, cwd=tmp_path, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
