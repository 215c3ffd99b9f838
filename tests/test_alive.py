"""The one failure detector (geotrain.comm.alive.Silence) that both the hub's watch and an
elastic round's peers read: counters that must grow, measured on this process's clock."""

from __future__ import annotations

import time

from geotrain.comm.alive import Silence


def test_silence_counts_only_counters_that_grow() -> None:
    s = Silence(["a", "b"], 1.0)
    t0 = time.monotonic()
    assert s.silent(t0) == {}  # nobody is silent before limit_s
    s.saw({"a": 3, "b": 0}, t0 + 0.5)
    s.saw({"a": 2, "b": 0}, t0 + 1.2)  # a replayed older value and a repeat are no beats
    assert set(s.silent(t0 + 1.6)) == {"a", "b"}
    s.saw({"a": 4}, t0 + 1.7)
    quiet = s.silent(t0 + 2.0)
    assert list(quiet) == ["b"] and abs(quiet["b"] - 1.5) < 1e-6
    assert s.silent(t0 + 2.0, ["a"]) == {}


def test_an_outage_is_nobodys_silence_and_a_restart_gives_time_again() -> None:
    s = Silence([0, 1], 1.0)
    now = time.monotonic()
    s.saw({0: 1, 1: 1}, now)
    s.excuse(5.0)  # the store could not be read for 5 s
    assert s.silent(now + 5.5) == {}
    assert set(s.silent(now + 6.5)) == {0, 1}
    s = Silence([0, 1], 0.2)
    time.sleep(0.3)
    s.restart([1])  # site 1 came back: it has limit_s from now
    assert list(s.silent(time.monotonic())) == [0]
