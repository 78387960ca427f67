"""The test suite: its tree mirrors the package's (tests/<subpackage>/ tests ciuicflow/<subpackage>/;
tests/bench/ tests bench/). Helpers shared across folders live in plain modules here (dist_utils,
devices, reference); fixtures in conftest.py files."""
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]  # the repository root
