"""``LayoutRules``: ``layout=``'s rules with one meaning on every backend (dict or ``LayoutMap``)."""

import keras
import pytest

from dp_core.keras import LayoutRules, spec_axes


class _SpecLike:
    """A partition spec that is no tuple (as jax's ``PartitionSpec`` is not): a sequence of entries."""

    def __init__(self, *entries):
        self.entries = entries

    def __iter__(self):
        return iter(self.entries)


def test_the_first_rule_whose_pattern_is_found_in_the_path_gives_the_spec():
    rules = LayoutRules(
        {"dense.*kernel": (None, "model"), "dense": ("model",), "embeddings": _SpecLike(["batch", "model"])}
    )
    assert rules.spec_for("dense_1/kernel") == (None, "model")
    assert rules.spec_for("dense_1/bias") == ("model",)
    assert rules.spec_for("embedding/embeddings") == (("batch", "model"),)  # a list entry: several axes
    assert rules.spec_for("batch_normalization/gamma") is None
    assert list(rules.named_axes()) == [
        ("dense.*kernel", (None, "model"), "model"),
        ("dense", ("model",), "model"),
        ("embeddings", (("batch", "model"),), "batch"),
        ("embeddings", (("batch", "model"),), "model"),
    ]
    assert spec_axes((None, ("batch", "model"), "model")) == ["batch", "model", "model"]
    assert not LayoutRules() and LayoutRules() == LayoutRules(None) and rules
    assert rules == LayoutRules(dict(rules.rules)) and hash(rules) == hash(LayoutRules(dict(rules.rules)))
    assert rules != LayoutRules({"dense.*kernel": ("model", None)})


def test_a_keras_layout_map_is_looked_up_as_keras_looks_it_up():
    layout_map = keras.distribution.LayoutMap(None)  # its device mesh is the trainer's
    layout_map["dense/kernel"] = (None, "model")
    rules = LayoutRules(layout_map)
    assert rules.spec_for("dense/kernel") == (None, "model")
    assert rules.spec_for("other/kernel") is None
    assert rules != LayoutRules({"dense/kernel": (None, "model")})  # Keras's lookup, not re.search


def test_rules_that_cannot_be_read_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"layout rule 'dense\[' is not a regular expression"):
        LayoutRules({"dense[": (None, "model")})
    with pytest.raises(TypeError, match=r"layout rule 'dense': expected a partition spec .* got 3"):
        LayoutRules({"dense": 3})
    with pytest.raises(TypeError, match=r"layout must be a dict .* got list"):
        LayoutRules([("dense", (None, "model"))])
