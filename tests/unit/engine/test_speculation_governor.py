"""tritonlm/engine/speculation_governor.py: speculation where this host's decode steps are
faster with it, decided from the steps' own times. The governor alone on made-up times, then
in a real engine whose steps it times by a made-up clock (no test depends on the host's
speed): greedy rows stop speculating once plain steps are cheaper and their text stays the
target's; a seeded sampled row speculates throughout, so its tokens are those it gets with
speculation always on."""

from __future__ import annotations

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_speculative_engine
from tritonlm.engine.speculation_governor import FIRST_PROBE, PROBE_EVERY, PROBE_STEPS, SpeculationGovernor

PROBE = PROBE_STEPS + 1  # a timing's steps: its first is not timed


def run(gov: SpeculationGovernor, rows: int, steps: int, cost: dict[bool, float | None]) -> list[bool]:
    """`steps` steps of `rows` rows, each taking cost[way] seconds a token (None: untimed): the ways taken."""
    ways = []
    for _ in range(steps):
        way = gov.speculate(rows)
        ways.append(way)
        gov.observe(rows, way, None if cost[way] is None else cost[way] * 10, 10)
    return ways


def test_it_starts_speculating_and_turns_it_off_where_plain_steps_are_cheaper():
    gov = SpeculationGovernor()
    ways = run(gov, 1, FIRST_PROBE + PROBE + 10, {True: 2.0, False: 1.0})
    assert ways[:FIRST_PROBE] == [True] * FIRST_PROBE
    assert ways[FIRST_PROBE:FIRST_PROBE + PROBE] == [False] * PROBE  # the first timing of plain steps
    assert ways[FIRST_PROBE + PROBE:] == [False] * 10  # and it stays
    assert gov.state()[1][0] is False


def test_a_timings_first_step_is_not_timed():
    """The first step of a timing pays for what the other way left undone (a draft model
    catching up): however dear, it does not count."""
    gov = SpeculationGovernor()
    run(gov, 1, FIRST_PROBE, {True: 1.0, False: 1.0})
    gov.observe(1, gov.speculate(1), 500.0, 10)  # plain, the timing's first step: 50 s a token
    run(gov, 1, PROBE_STEPS, {True: 1.0, False: 0.5})
    assert gov.state()[1][1][False] == 0.5
    assert not gov.speculate(1)


def test_it_keeps_speculating_where_that_is_cheaper_and_looks_again_now_and_then():
    gov = SpeculationGovernor()
    # plain steps cost twice as much a token: timed again after 2 x PROBE_EVERY steps
    ways = run(gov, 4, FIRST_PROBE + PROBE + 2 * PROBE_EVERY + PROBE + 2, {True: 0.5, False: 1.0})
    assert ways.count(False) == 2 * PROBE
    assert ways[-PROBE - 3] is True and ways[-PROBE - 2:-2] == [False] * PROBE
    assert ways[-1] is True


def test_a_far_dearer_way_is_timed_so_much_less_often():
    """Speculation at 30 plain steps' cost a token: after the first timing, it is timed again
    only after 30 x PROBE_EVERY plain steps, so timing it costs a bounded share of the time."""
    gov = SpeculationGovernor()
    ways = run(gov, 1, FIRST_PROBE + PROBE + 30 * PROBE_EVERY, {True: 30.0, False: 1.0})
    assert ways[FIRST_PROBE + PROBE:] == [False] * (30 * PROBE_EVERY)
    assert run(gov, 1, 1, {True: 30.0, False: 1.0}) == [True]  # and then it is


def test_a_way_must_be_clearly_cheaper_to_take_over():
    gov = SpeculationGovernor()
    ways = run(gov, 1, FIRST_PROBE + PROBE + 5, {True: 1.0, False: 0.97})
    assert ways[-5:] == [True] * 5  # 3% is within the hysteresis


def test_steps_it_cannot_time_decide_nothing_and_are_not_timed_again_and_again():
    """Plain steps that are never the governor's alone (seeded rows speculating in them):
    the timing decides nothing, speculation stays on, and the next try comes only after
    PROBE_EVERY steps, not FIRST_PROBE."""
    gov = SpeculationGovernor()
    ways = run(gov, 2, FIRST_PROBE + PROBE + PROBE_EVERY + PROBE, {True: 1.0, False: None})
    assert ways[FIRST_PROBE + PROBE:FIRST_PROBE + PROBE + PROBE_EVERY] == [True] * PROBE_EVERY
    assert ways[-PROBE:] == [False] * PROBE
    assert gov.speculate(2) and False not in gov.state()[2][1]


def test_it_turns_speculation_back_on_when_the_text_makes_it_pay():
    gov = SpeculationGovernor()
    run(gov, 1, FIRST_PROBE + PROBE, {True: 2.0, False: 1.0})
    assert not gov.speculate(1)
    ways = run(gov, 1, 2 * PROBE_EVERY + PROBE + 3, {True: 0.4, False: 1.0})  # a quote: guesses now land
    assert ways[-3:] == [True] * 3


def test_batch_sizes_are_decided_apart():
    gov = SpeculationGovernor()
    run(gov, 1, FIRST_PROBE + PROBE, {True: 2.0, False: 1.0})
    run(gov, 32, FIRST_PROBE + PROBE, {True: 0.5, False: 1.0})
    assert not gov.speculate(1) and gov.speculate(32) and gov.speculate(40)  # 32 and 40: one bucket
    assert gov.bucket_of(2) == gov.bucket_of(3) != gov.bucket_of(4)


def fake_clock(engine) -> None:
    """The governor sees a speculating step as taking three times a plain one's 1 s."""
    gov = engine.executor.governor
    real = gov.observe
    gov.observe = lambda rows, speculated, seconds, tokens: real(
        rows, speculated, None if seconds is None else (3.0 if speculated else 1.0), tokens)


def test_in_an_engine_greedy_rows_stop_guessing_once_plain_steps_are_cheaper():
    """A draft that is nearly always wrong, and a clock by which a speculating step costs
    three plain ones: after the first timing the governor turns speculation off, and each
    answer is the target's own."""
    engine = make_speculative_engine("random", k=3, adaptive_speculation=True)
    fake_clock(engine)
    col = Collector()
    rids = [col.request(engine, p, max_tokens=40) for p in MIXED_PROMPTS[:2]]
    drain(engine)
    for p, rid in zip(MIXED_PROMPTS, rids):
        assert col.ids(rid) == hf_greedy_text(p, 40)
        assert 0 < col.final(rid).draft_tokens <= 3 * FIRST_PROBE  # guessed in the first steps only
    way, cost = engine.executor.governor.state()[SpeculationGovernor.bucket_of(2)]
    assert way is False and cost[False] < cost[True]


def test_in_an_engine_a_seeded_row_speculates_as_configured():
    """A seeded sampled row beside greedy ones guesses whatever the governor decides: its
    tokens and its guesses are those of an engine that always speculates."""
    results = []
    for adaptive in (False, True):
        engine = make_speculative_engine("random", k=3, adaptive_speculation=adaptive)
        if adaptive:
            fake_clock(engine)
        col = Collector()
        greedy = col.request(engine, MIXED_PROMPTS[0], max_tokens=40)
        seeded = col.request(engine, MIXED_PROMPTS[2], max_tokens=40, temperature=0.9, seed=17)
        drain(engine)
        assert col.ids(greedy) == hf_greedy_text(MIXED_PROMPTS[0], 40)
        results.append((col.ids(seeded), col.final(seeded).draft_tokens))
    assert results[0] == results[1] and results[0][1] > 0
