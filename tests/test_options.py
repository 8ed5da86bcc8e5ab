"""The shared option helpers: integer checks, gamma -> budget policy, drafter options, cache root."""

import pytest

from specdec.budget import AutoBudget, FixedBudget, budget_policy_for, parse_gamma
from specdec.checks import check_int, check_positive_int
from specdec.drafters import drafter_options, make_drafter
from specdec.paths import cache_root


def test_check_int_accepts_integers_in_range_and_names_the_option_otherwise():
    assert check_int("n", 0, 0) == 0 and check_int("n", 7, 1, 7) == 7 and check_positive_int("n", 1) == 1
    for value, low, high in [(0, 1, None), (8, 1, 7), (True, 0, None), (2.0, 1, None), ("3", 1, None), (None, 0, None)]:
        with pytest.raises(ValueError, match="^width must be an integer"):
            check_int("width", value, low, high)


def test_parse_gamma():
    assert [parse_gamma(raw) for raw in ("auto", None, "0", "12", 3)] == ["auto", None, 0, 12, 3]
    for bad in ("-1", "many", "2.5", -2, 1.5, True):
        with pytest.raises(ValueError, match="gamma must be 'auto' or an integer >= 0"):
            parse_gamma(bad)


def test_budget_policy_for_each_gamma(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # the cost table is measured into a fresh cache
    drafter = make_drafter("pld", tiny_target, gamma=3)
    fixed = budget_policy_for(tiny_target, drafter, "4")
    assert isinstance(fixed, FixedBudget) and fixed.max_budget_for(drafter) == 4
    assert budget_policy_for(tiny_target, drafter, None).max_budget_for(drafter) == 3  # the drafter's default
    assert budget_policy_for(tiny_target, None, "auto").max_budget_for(None) == 0  # plain decoding: no cost table
    assert isinstance(budget_policy_for(tiny_target, drafter, "auto"), AutoBudget)
    assert list((tmp_path / "cost").glob("*.json"))
    with pytest.raises(ValueError, match="gamma"):
        budget_policy_for(tiny_target, drafter, "-3")


def test_drafter_options_convert_with_the_constructors_annotations():
    assert drafter_options("pld", ["max-ngram=3", "gamma=2"]) == {"max_ngram": 3, "gamma": 2}
    assert drafter_options("suffix", ["tree=false", "min_prob=0.25"]) == {"tree": False, "min_prob": 0.25}
    with pytest.raises(ValueError, match=r"pld takes KEY=VALUE with KEY in \['max_ngram', 'min_ngram', 'gamma'\]"):
        drafter_options("pld", ["target=x"])
    with pytest.raises(ValueError, match="expected true/false"):
        drafter_options("suffix", ["tree=maybe"])
    with pytest.raises(ValueError, match="unknown drafter"):
        drafter_options("nope", [])


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    from specdec.cost import default_cache_path
    from specdec.kernels import kernel_cache_dir
    from specdec.models.registry import model_cache_dir

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    assert kernel_cache_dir().parent == default_cache_path({}).parent.parent == tmp_path
    assert model_cache_dir("m").is_relative_to(tmp_path / "models")  # models/v<converter>/m: versions never share a dir
    monkeypatch.delenv("SPECDEC_CACHE")
    assert cache_root().parts[-2:] == (".cache", "specdec")
