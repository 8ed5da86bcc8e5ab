"""What users are offered: `specdec drafters` (the real CLI) and the unknown-drafter error name the
drafting methods; the testing drafters (registered with listed=False) are left out, yet tests and
`--drafter NAME` still build them by name."""

import os
import subprocess
import sys
from pathlib import Path

from specdec.drafters import listed_drafters, make_drafter, registered_drafters

REPO = Path(__file__).resolve().parents[1]
TESTING_DRAFTERS = {"oracle", "random", "tempered"}


def _cli(*argv):
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "specdec.cli", *argv], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)


def test_specdec_drafters_lists_the_methods_but_not_the_testing_drafters():
    result = _cli("drafters")
    assert result.returncode == 0, result.stderr
    rows = [line.split("│") for line in result.stdout.splitlines() if line.startswith("│")]
    names = {cells[1].strip() for cells in rows} - {""}
    assert {"pld", "eagle3", "dspark", "small-model"} <= names
    assert names == set(listed_drafters()) and not names & TESTING_DRAFTERS
    unknown = _cli("generate", "Hi", "--drafter", "no-such-drafter")
    assert unknown.returncode == 2 and "unknown drafter 'no-such-drafter'; available: auto, bigram, dflash" in unknown.stderr
    assert not any(name in unknown.stderr for name in TESTING_DRAFTERS)


def test_testing_drafters_are_registered_unlisted_and_still_built_by_name(tiny_target):
    assert set(registered_drafters()) - set(listed_drafters()) == TESTING_DRAFTERS
    for name in sorted(TESTING_DRAFTERS):
        assert make_drafter(name, tiny_target, gamma=2).name == name
