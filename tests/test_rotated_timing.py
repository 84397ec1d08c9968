"""devtools.rotated_timing: every candidate takes every slot; every round's value, and medians, by name."""
import pytest

from streamkl_gpu.devtools.rotated_timing import rotated_medians, rotated_samples, rotation


def test_each_name_takes_each_slot_in_turn():
    order = rotation(["a", "b", "c"], 6)
    assert order[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]] and order[3:] == order[:3]
    for slot in range(3):
        assert sorted(o[slot] for o in order[:3]) == ["a", "b", "c"]


def test_a_slot_bias_does_not_pick_the_winner():
    """Two identical candidates and a timer that charges 10 % more for the first slot of every round:
    a fixed order would make the first name look slower; rotated, the medians are equal."""
    seen = []

    def timer(fn):
        first = not seen or len(seen) % 2 == 0
        seen.append(fn)
        return 1.1 if first else 1.0

    calls = []
    ms = rotated_medians({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}, rounds=4, timer=timer)
    assert calls == ["x", "y"]  # one warm-up call each, before the rounds
    assert ms["x"] == ms["y"]


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="one round"):
        rotated_medians({"x": lambda: None}, rounds=0, timer=lambda fn: 1.0)


def test_samples_keep_every_round_in_order():
    """A timer that counts its calls: each name gets one value per round, in round order, and the
    medians are the samples' medians."""
    n = iter(range(100))
    samples = rotated_samples({"x": lambda: None, "y": lambda: None}, rounds=3, timer=lambda fn: float(next(n)))
    # rounds: x y | y x | x y -> x gets 0, 3, 4; y gets 1, 2, 5
    assert samples == {"x": [0.0, 3.0, 4.0], "y": [1.0, 2.0, 5.0]}
    n = iter(range(100))
    assert rotated_medians({"x": lambda: None, "y": lambda: None}, rounds=3, timer=lambda fn: float(next(n))) == \
        {"x": 3.0, "y": 2.0}
