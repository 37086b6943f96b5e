"""tritonlm/engine/speculation_governor.py: speculation where this host's decode steps are
faster with it, decided from the steps' own times. The governor alone on made-up times, then
in a real engine whose steps it times by a made-up clock (no test depends on the host's
speed): greedy rows stop speculating once plain steps are cheaper and their text stays the
target's; a seeded sampled row speculates throughout, so its tokens are those it gets with
speculation always on."""

from __future__ import annotations

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_speculative_engine, tiny
from tritonlm.engine.speculation_governor import FIRST_PROBE, PROBE_EVERY, PROBE_STEPS, SpeculationGovernor


def run(gov: SpeculationGovernor, rows: int, steps: int, cost: dict[bool, float]) -> list[bool]:
    """`steps` steps of `rows` rows, each taking cost[way] seconds a token: the ways taken."""
    ways = []
    for _ in range(steps):
        way = gov.speculate(rows)
        ways.append(way)
        gov.observe(rows, way, cost[way] * 10, 10)
    return ways


def test_it_starts_speculating_and_turns_it_off_where_plain_steps_are_cheaper():
    gov = SpeculationGovernor()
    ways = run(gov, 1, FIRST_PROBE + PROBE_STEPS + 10, {True: 2.0, False: 1.0})
    assert ways[:FIRST_PROBE] == [True] * FIRST_PROBE
    assert ways[FIRST_PROBE:FIRST_PROBE + PROBE_STEPS] == [False] * PROBE_STEPS  # the first timing of plain steps
    assert ways[FIRST_PROBE + PROBE_STEPS:] == [False] * 10  # and it stays
    assert gov.state()[1][0] is False


def test_it_keeps_speculating_where_that_is_cheaper_and_looks_again_now_and_then():
    gov = SpeculationGovernor()
    # plain steps cost twice as much a token: timed again after 2 x PROBE_EVERY steps
    ways = run(gov, 4, FIRST_PROBE + PROBE_STEPS + 2 * PROBE_EVERY + PROBE_STEPS + 2, {True: 0.5, False: 1.0})
    assert ways.count(False) == 2 * PROBE_STEPS
    assert ways[-PROBE_STEPS - 3] is True and ways[-PROBE_STEPS - 2:-2] == [False] * PROBE_STEPS
    assert ways[-1] is True


def test_a_far_dearer_way_is_timed_so_much_less_often():
    """Speculation at 30 plain steps' cost a token: after the first timing, it is timed again
    only after 30 x PROBE_EVERY plain steps, so timing it costs a bounded share of the time."""
    gov = SpeculationGovernor()
    ways = run(gov, 1, FIRST_PROBE + PROBE_STEPS + 30 * PROBE_EVERY, {True: 30.0, False: 1.0})
    assert ways[FIRST_PROBE + PROBE_STEPS:] == [False] * (30 * PROBE_EVERY)
    assert run(gov, 1, 1, {True: 30.0, False: 1.0}) == [True]  # and then it is


def test_a_way_must_be_clearly_cheaper_to_take_over():
    gov = SpeculationGovernor()
    ways = run(gov, 1, FIRST_PROBE + PROBE_STEPS + 5, {True: 1.0, False: 0.97})
    assert ways[-5:] == [True] * 5  # 3% is within the hysteresis


def test_it_turns_speculation_back_on_when_the_text_makes_it_pay():
    gov = SpeculationGovernor()
    run(gov, 1, FIRST_PROBE + PROBE_STEPS, {True: 2.0, False: 1.0})
    assert not gov.speculate(1)
    ways = run(gov, 1, 2 * PROBE_EVERY + PROBE_STEPS + 3, {True: 0.4, False: 1.0})  # a quote: guesses now land
    assert ways[-3:] == [True] * 3


def test_batch_sizes_are_decided_apart():
    gov = SpeculationGovernor()
    run(gov, 1, FIRST_PROBE + PROBE_STEPS, {True: 2.0, False: 1.0})
    run(gov, 32, FIRST_PROBE + PROBE_STEPS, {True: 0.5, False: 1.0})
    assert not gov.speculate(1) and gov.speculate(32) and gov.speculate(40)  # 32 and 40: one bucket
    assert gov.bucket_of(2) == gov.bucket_of(3) != gov.bucket_of(4)


def test_in_an_engine_greedy_rows_stop_guessing_and_seeded_rows_keep_their_tokens():
    """A draft that is nearly always wrong, and a clock by which a speculating step costs
    three plain ones: greedy rows stop guessing after the first timing, their text the
    target's alone; a seeded sampled row guesses on, its tokens those of an engine that
    always speculates."""
    results = {}
    for adaptive in (False, True):
        engine = make_speculative_engine("random", k=3, adaptive_speculation=adaptive)
        if adaptive:
            gov = engine.executor.governor
            real = gov.observe
            gov.observe = lambda rows, speculated, seconds, tokens: real(rows, speculated, 3.0 if speculated else 1.0,
                                                                           tokens)
        col = Collector()
        greedy = [col.request(engine, p, max_tokens=40) for p in MIXED_PROMPTS[:2]]
        seeded = col.request(engine, MIXED_PROMPTS[2], max_tokens=40, temperature=0.9, seed=17)
        drain(engine)
        results[adaptive] = col, greedy, seeded
    (plain, g0, s0), (gov_col, g1, s1) = results[False], results[True]
    for p, a, b in zip(MIXED_PROMPTS, g0, g1):
        assert gov_col.ids(b) == plain.ids(a) == hf_greedy_text(p, 40)
        assert 0 < gov_col.final(b).draft_tokens < plain.final(a).draft_tokens / 2  # guessed early on only
    assert gov_col.ids(s1) == plain.ids(s0)
    assert gov_col.final(s1).draft_tokens == plain.final(s0).draft_tokens > 0
    assert tiny()[1].decode(gov_col.ids(g1[0]))
