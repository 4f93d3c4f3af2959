"""The elastic job's syncer, called in one event loop without Ray: the rounds'
members at the grace deadline, late islands, joins refused (another config, a
taken id), resumes, heal routing when a peer dies, and the end of the job."""

import asyncio
import time

import pytest

from sdiloco.distributed.syncer import Syncer


FIELDS = {"model": '"tiny-xxs"', "seed": "0", "method.sync_every": "6"}


class _Handle:
    def __init__(self, actor_id: str):
        self._actor_id = bytes.fromhex(actor_id)


class _Syncer(Syncer):
    """The syncer with each message's object a plain token (no Ray)."""

    async def _own(self, name, m):
        return f"{name}/{m}"


def _syncer(m=3, **kw) -> _Syncer:
    kw = dict(grace_s=0.3, start_s=5.0, heartbeat_s=5.0, serve_s=0.5) | kw
    s = _Syncer(m, FIELDS, **kw)
    for i in range(m):
        s.register(i, _Handle(f"{i:02x}" * 4))
    return s


async def _hello_all(s: Syncer, steps=(0, 0, 0)):
    calls = [
        s.hello(m, s.owners[m], FIELDS, step, 100 + m) for m, step in enumerate(steps)
    ]
    return await asyncio.gather(*calls)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_round_is_decided_when_every_island_arrived():
    async def go():
        s = _syncer()
        await _hello_all(s)
        out = await asyncio.gather(*(s.arrive("6-0", m, True) for m in range(3)))
        members, refs = out[0]
        assert members == (0, 1, 2) and refs == {m: [f"6-0/{m}"] for m in range(3)}
        assert all(o == out[0] for o in out)  # every island: the same decision
        assert s.decisions[0].timed_out is False
        assert s.decisions[0].waited_s < 0.2

    run(go())


def test_a_missing_island_is_left_out_at_the_grace_deadline_then_waited_for_again():
    async def go():
        s = _syncer()
        await _hello_all(s)
        start = time.monotonic()
        out = await asyncio.gather(s.arrive("6-0", 0, True), s.arrive("6-0", 2, True))
        assert 0.3 <= time.monotonic() - start < 1.0  # one grace window
        assert out[0][0] == (0, 2) and s.decisions[0].timed_out
        assert s.expected == {0, 2}  # no longer waited for
        # island 1 arrives within a grace window of the decision: about one round
        # behind, it reads the round (as a non-member) and is waited for again.
        late = await s.arrive("6-0", 1, True)
        assert late[0] == (0, 2) and s.expected == {0, 1, 2}
        out = await asyncio.gather(*(s.arrive("12-0", m, True) for m in range(3)))
        assert out[0][0] == (0, 1, 2) and not s.decisions[1].timed_out

    run(go())


def test_an_island_later_than_a_grace_window_is_told_it_is_behind():
    async def go():
        s = _syncer()
        await _hello_all(s)
        await asyncio.gather(s.arrive("6-0", 0, True), s.arrive("6-0", 2, True))
        await asyncio.sleep(0.35)
        await s.arrive("6-0", 1, True)
        assert 1 not in s.expected and s.behind == {1}
        letters = await s.mail(1, wait_s=0.1)
        assert [w for w, _ in letters] == ["behind"]

    run(go())


def test_an_island_with_another_config_is_refused_naming_the_fields():
    async def go():
        s = _syncer()
        other = dict(FIELDS, seed="1", **{"method.sync_every": "12"})
        answer = await s.hello(1, s.owners[1], other, 0, 7)
        line = answer["refused"]
        assert "island 1 refused" in line and "method.sync_every, seed" in line
        assert "\n" not in line and s.refused == [line]
        assert 1 not in s.greeted  # the job still waits for the right island 1

    run(go())


def test_a_second_process_claiming_a_live_islands_id_is_refused():
    async def go():
        s = _syncer()
        for who in ("ffffffff", None):  # another actor, or no actor at all
            answer = await s.hello(2, who, FIELDS, 0, 9)
            assert "island 2 is already held by actor" in answer["refused"]
        answer = await s.hello(7, None, FIELDS, 0, 9)
        assert answer["refused"] == "island 7; allowed: 0 ... 2."

    run(go())


def test_a_resumed_job_starts_at_the_newest_checkpoint_and_the_others_heal():
    async def go():
        s = _syncer()
        answers = await _hello_all(s, steps=(40, 30, 40))
        assert [a["start_step"] for a in answers] == [40, 40, 40]
        assert [a["heal"] for a in answers] == [False, True, False]
        assert s.healing == {1} and s.expected == {0, 2}
        # a restarted island (its id said hello before) heals too
        again = await s.hello(0, s.owners[0], FIELDS, 40, 200)
        assert again["heal"]

    run(go())


def test_a_heal_goes_to_a_recent_member_and_is_routed_again_when_its_peer_dies():
    async def go():
        s = _syncer()
        await _hello_all(s)
        await asyncio.gather(*(s.arrive("6-0", m, True) for m in range(3)))
        s.recent = (0, 2)
        asked = asyncio.create_task(s.want_heal(1, "n1"))
        await asyncio.sleep(0.05)
        assert s.serving == {0: (1, "n1")}  # the first recent member
        assert (await s.mail(0, 0.1)) == [("serve", "1:n1")]
        s.lost(0, permanent=False)  # it died before it offered
        await asyncio.sleep(0.1)
        assert s.serving == {2: (1, "n1")}  # routed again at once
        assert (await s.mail(2, 0.1)) == [("serve", "1:n1")]
        s.offer("n1", ["state"])
        assert await asked == ["state"]
        s.healed(1, "n1")
        assert 1 in s.expected and not s.healing and not s.serving

    run(go())


def test_a_peer_that_does_not_offer_within_serve_s_is_passed_over():
    async def go():
        s = _syncer(serve_s=0.2)
        await _hello_all(s)
        asked = asyncio.create_task(s.want_heal(1, "n"))
        await asyncio.sleep(0.05)
        first = set(s.serving)
        await asyncio.sleep(0.25)
        assert set(s.serving) and set(s.serving) != first  # another peer
        s.offer("n", ["x"])
        assert await asked == ["x"]

    run(go())


def test_the_job_ends_when_every_island_that_can_finish_is_done():
    async def go():
        s = _syncer()
        await _hello_all(s)
        s.finished(0)
        assert not await s.wait_end(0.05)
        s.lost(1, permanent=True)  # no restart left: it cannot finish
        s.finished(2)
        assert await s.wait_end(0.05)

    run(go())


def test_an_island_restored_at_the_runs_last_step_does_not_heal():
    # Killed after its checkpoint of the last step (under load, after the others
    # had finished): it has trained every step, and its θ_g is the one it ended
    # with, so it does not ask a peer (that may have left) for a state.
    async def go():
        s = _syncer(steps=240)
        await _hello_all(s, steps=(240, 240, 240))
        again = await s.hello(0, s.owners[0], FIELDS, 240, 200)
        assert again["heal"] is False and 0 not in s.healing
        midway = await s.hello(1, s.owners[1], FIELDS, 200, 201)  # restarted earlier
        assert midway["heal"] is True

    run(go())


def test_a_heal_with_no_island_left_to_serve_it_ends_at_once():
    # Every other island finished and left (none live): the heal cannot come, and
    # the asker is told so at once instead of waiting for ever.
    async def go():
        s = _syncer(heartbeat_s=0.1)
        await _hello_all(s)
        s.finished(0)
        s.finished(2)
        asked = asyncio.create_task(s.want_heal(1, "n"))
        await asyncio.sleep(0.05)
        assert not asked.done()  # 0 and 2 still serve, within the heartbeat
        await asyncio.sleep(0.2)
        assert await asyncio.wait_for(asked, 1.0) == [None]

    run(go())


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.arrive("x" * 100, 0, True),
        lambda s: s.arrive("6-0", "0", True),
        lambda s: s.arrive("6-0", 3, True),
        lambda s: s.want_heal(-1, "n"),
        lambda s: s.mail(99),
    ],
)
def test_a_malformed_call_fails_alone(call):
    async def go():
        s = _syncer()
        with pytest.raises(ValueError):
            await call(s)
        await _hello_all(s)  # the syncer goes on
        out = await asyncio.gather(*(s.arrive("6-0", m, True) for m in range(3)))
        assert out[0][0] == (0, 1, 2)

    run(go())


def test_an_island_not_healed_yet_never_counts_in_a_round():
    # A restarted island alone with its fresh weights cannot make a round of its
    # own: until it healed from a peer, its messages are refused.
    async def go():
        s = _syncer(grace_s=0.1)
        answers = await _hello_all(s, steps=(40, 0, 40))
        assert answers[1]["heal"]
        s.lost(0, permanent=False)
        s.lost(2, permanent=False)
        members, refs = await s.arrive("42-0", 1, True)
        assert members == () and refs == {} and s.unhealed_posts == 1

    run(go())


def test_a_healed_island_finds_the_rounds_in_flight_in_the_state_it_took():
    # Healed at step 12: round 12-0 is in flight in its peer's state. The members'
    # reads must not drop it before the healed island read it, however long it
    # took to go on (here: longer than the heartbeat, not live any more).
    async def go():
        s = _syncer(heartbeat_s=0.05)
        await _hello_all(s)
        s.healing.add(1)
        s.expected.discard(1)
        await asyncio.gather(s.arrive("12-0", 0, True), s.arrive("12-0", 2, True))
        s.healed(1, "n", step=12)
        await asyncio.sleep(0.1)  # island 1 silent longer than the heartbeat
        s.got("12-0", 0)
        s.got("12-0", 2)
        members, refs = await s.arrive("12-0", 1, False)
        assert members == (0, 2) and set(refs) == {0, 2}
        s.got("12-0", 1)
        assert not s.rounds["12-0"].refs  # now every reader has it
        await s.arrive("18-0", 1, True)  # it posts again: no longer rejoining
        assert 1 not in s.rejoining

    run(go())
