"""A long wait says what runs, how far it got, the time left and how to skip it (core/progress.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vqserve.core.progress import Progress, duration


class Clock:
    """A clock the test moves by hand: the lines depend on elapsed time."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_first_step_is_said_at_once_with_what_runs_and_how_to_skip():
    said, clock = [], Clock()
    p = Progress("start-up check", 42, say=lambda line, fields: said.append((line, fields)),
                 skip="--no-self-check", clock=clock, bar=False)
    p.step("each image alone")
    assert len(said) == 1
    line, fields = said[0]
    assert line.startswith("start-up check: each image alone, 0/42 images")
    assert "estimating the time left" in line and "(skip: --no-self-check)" in line
    assert fields["step"] == "each image alone" and fields["eta_s"] is None


def test_time_left_comes_from_the_pace_of_the_first_units():
    said, clock = [], Clock()
    p = Progress("start-up check", 10, say=lambda line, fields: said.append((line, fields)), clock=clock, bar=False)
    p.step("alone")
    clock.now += 3.0
    p.advance(1)  # 3 s per image, 9 left
    line, fields = said[-1]
    assert fields["eta_s"] == 27.0 and "~27 s left" in line and "1/10 images" in line


def test_quiet_within_the_interval_then_a_line_at_least_every_interval():
    said, clock = [], Clock()
    p = Progress("check", 100, say=lambda line, fields: said.append(line), clock=clock, interval_s=2.0, bar=False)
    p.step("a")
    for _ in range(5):  # fast steps and units: no more lines
        clock.now += 0.1
        p.advance(1)
        p.step("b")
    assert len(said) == 1
    clock.now += 2.0
    p.advance(1)
    assert len(said) == 2
    p.step("c")  # past the first interval every step is said
    assert len(said) == 3 and "check: c," in said[-1]


def test_done_says_the_given_line_and_resize_keeps_counts():
    said, clock = [], Clock()
    p = Progress("check", 42, say=lambda line, fields: said.append((line, fields)), clock=clock, bar=False)
    p.step("a")
    p.advance(2)
    p.resize(4)
    assert p.total == 4 and "2/4 images" in p.line()
    p.done("check done in 1.0 s")
    assert said[-1][0] == "check done in 1.0 s" and said[-1][1]["step"] == "done"


@given(st.floats(min_value=0, max_value=10 * 86400, allow_nan=False))
def test_duration_reads_as_a_person_reads_it(seconds):
    text = duration(seconds)
    assert text.endswith((" s", " min")) and text[0].isdigit()


def test_a_usually_short_wait_says_nothing_until_it_is_long_then_beats():
    """``say_first=False`` (an import of a small checkpoint): silent within the first interval;
    the heartbeat then says the step every interval while nothing else happens."""
    import threading

    said, clock = [], Clock()
    spoke = threading.Event()
    p = Progress("vqserve import", None, say=lambda line, fields: (said.append(line), spoke.set()),
                 clock=clock, interval_s=0.05, say_first=False, bar=False)
    p.step("converting")
    assert said == []
    p.heartbeat()
    clock.now += 1.0  # the wait grew long
    assert spoke.wait(30)
    p.close()
    assert said[0] == "vqserve import: converting, 1 s so far"
