"""The rules of rollouts (binary reward, NUL-free text, how a payload is given) and integral floats
as integers: checked once over a whole commit, ingest or task completion, each error at the place
that breaks a rule (`groups.i.rollouts.j...`); a rollout, a group or a payload validated on its
own checks itself the same way."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from exgrpo_client import frames, rollout
from exgrpo_client import schemas as s

IDS, LPS = s.pack_ids([1, 2, 3]), s.pack_logprobs([-0.5] * 3)
GOOD: dict[str, Any] = {"reward": 1.0, "token_ids_b64": IDS, "logprobs_b64": LPS, "text": "ok"}

#: rule -> (the broken rollout, where its error is under the rollout, words of the message)
BROKEN: dict[str, tuple[dict[str, Any], tuple[str | int, ...], str]] = {
    "reward": ({**GOOD, "reward": 0.5}, ("reward",), "Value error, reward must be 0 or 1"),
    "text": ({**GOOD, "text": "a\x00"}, ("text",), "Value error, must not contain NUL characters"),
    "ids twice": ({**GOOD, "token_ids": [1, 2, 3]}, (), "give token_ids or token_ids_b64, not both"),
    "log-probs twice": ({**GOOD, "logprobs": [-0.5] * 3}, (), "give logprobs or logprobs_b64, not both"),
    "ids alone": ({"reward": 1.0, "token_ids_b64": IDS}, (), "come together: give both or neither"),
    "log-probs alone": ({"reward": 0.0, "logprobs": [-1.0]}, (), "come together: give both or neither"),
}


def _errors(e: ValidationError) -> list[tuple[tuple[str | int, ...], str]]:
    return [(tuple(x["loc"]), x["msg"]) for x in e.errors()]


def _commit(bad: dict[str, Any]) -> dict[str, Any]:
    """A commit of three groups whose second group's third rollout is `bad`."""
    groups = [{"question_id": q, "rollouts": [GOOD, {"reward": 0.0}, GOOD]} for q in (1, 2, 3)]
    groups[1]["rollouts"][2] = bad
    return {"groups": groups, "policy_version": 1}


@pytest.mark.parametrize("rule", list(BROKEN))
@pytest.mark.parametrize("model", [s.BatchCommit, s.IngestRequest])
def test_a_request_names_the_rollout_that_breaks_a_rule(model: type[BaseModel], rule: str) -> None:
    bad, under, words = BROKEN[rule]
    body = _commit(bad)
    for validate in (lambda: model.model_validate(body), lambda: model.model_validate_json(json.dumps(body))):
        with pytest.raises(ValidationError) as e:
            validate()
        [(loc, msg)] = _errors(e.value)
        assert loc == ("groups", 1, "rollouts", 2, *under) and words in msg, (loc, msg)


@pytest.mark.parametrize("rule", list(BROKEN))
def test_a_task_completion_names_the_rollout_that_breaks_a_rule(rule: str) -> None:
    bad, under, words = BROKEN[rule]
    with pytest.raises(ValidationError) as e:
        s.TaskComplete.model_validate({"lease_token": "t", "rollouts": [GOOD, GOOD, bad]})
    [(loc, msg)] = _errors(e.value)
    assert loc == ("rollouts", 2, *under) and words in msg


@pytest.mark.parametrize("rule", list(BROKEN))
def test_a_rollout_or_a_group_on_its_own_checks_itself(rule: str) -> None:
    bad, under, words = BROKEN[rule]
    checks: list[tuple[Any, tuple[str | int, ...]]] = [
        (lambda: s.RolloutResult(**bad), under),
        (lambda: s.RolloutResult.model_validate(bad), under),
        (lambda: s.RolloutResult.model_validate_json(json.dumps(bad)), under),
        (lambda: s.GroupResult(question_id=1, rollouts=[GOOD, bad]), ("rollouts", 1, *under)),
        (
            lambda: s.TaskGroupResult.model_validate({"question_id": 1, "rollouts": [bad]}),
            ("rollouts", 0, *under),
        ),
    ]
    for validate, where in checks:
        with pytest.raises(ValidationError) as e:
            validate()
        [(loc, msg)] = _errors(e.value)
        assert loc == where and words in msg, (loc, msg)


def test_a_payload_on_its_own_needs_exactly_one_of_each() -> None:
    assert s.Payload(token_ids_b64=IDS, logprobs=[-1.0, -1.0, -1.0]).logprobs == [-1.0] * 3
    for fields, words in (
        ({"logprobs_b64": LPS}, "exactly one of token_ids or token_ids_b64"),
        ({"token_ids": [1], "token_ids_b64": IDS, "logprobs_b64": LPS}, "exactly one of token_ids"),
        ({"token_ids": [1]}, "exactly one of logprobs or logprobs_b64"),
    ):
        with pytest.raises(ValidationError, match=words):
            s.Payload.model_validate(fields)


def test_every_broken_rollout_is_named_but_field_errors_come_first() -> None:
    body = _commit(BROKEN["reward"][0])
    body["groups"][0]["rollouts"][1] = BROKEN["ids alone"][0]
    with pytest.raises(ValidationError) as e:
        s.BatchCommit.model_validate(body)
    assert [loc for loc, _ in _errors(e.value)] == [
        ("groups", 0, "rollouts", 1),
        ("groups", 1, "rollouts", 2, "reward"),
    ]
    # a rollout whose own fields are wrong is refused for them, not for its payload's shape
    with pytest.raises(ValidationError) as e:
        s.RolloutResult.model_validate({**BROKEN["ids twice"][0], "reward": 2.0, "text": "\x00"})
    assert [loc for loc, _ in _errors(e.value)] == [("reward",), ("text",)]


def test_integral_floats_are_integers_anywhere_in_a_request() -> None:
    body = _commit({"reward": 1.0, "token_ids": [7.0, 8, 2.0**31 - 1], "logprobs": [-1, -1.0, -2]})
    body["policy_version"] = 3.0
    body["groups"][0]["question_id"] = 5.0
    body["groups"][2]["replay_trajectory_id"] = 9.0
    sent = copy.deepcopy(body)
    for commit in (s.BatchCommit.model_validate(body), s.BatchCommit.model_validate_json(json.dumps(body))):
        assert commit.policy_version == 3 and type(commit.policy_version) is int
        assert commit.groups[0].question_id == 5 and commit.groups[2].replay_trajectory_id == 9
        assert commit.groups[1].rollouts[2].token_ids == [7, 8, 2**31 - 1]
        assert all(type(i) is int for i in commit.groups[1].rollouts[2].token_ids or [])
    assert body == sent  # the caller's body is left as it was
    assert s.RolloutResult.model_validate_json(
        '{"reward": 1, "token_ids": [3.0], "logprobs": [-1]}'
    ).token_ids == [3]
    assert (
        s.TaskComplete.model_validate(
            {"lease_token": "t", "rollouts": [GOOD], "policy_version": 2.0}
        ).policy_version
        == 2
    )


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"question_id": 5.5}, ("groups", 1, "question_id")),
        ({"question_id": True}, ("groups", 1, "question_id")),
        ({"replay_trajectory_id": 2.0**63}, ("groups", 1, "replay_trajectory_id")),
        (
            {"rollouts": [{"reward": 1.0, "token_ids": [1.0, 2.5], "logprobs": [-1.0] * 2}]},
            ("groups", 1, "rollouts", 0, "token_ids", 1),
        ),
        (
            {"rollouts": [{"reward": 1.0, "token_ids": [1.0, "2"], "logprobs": [-1.0] * 2}]},
            ("groups", 1, "rollouts", 0, "token_ids", 1),
        ),
        (
            {"rollouts": [{"reward": 1.0, "token_ids": [-1.0], "logprobs": [-1.0]}]},
            ("groups", 1, "rollouts", 0, "token_ids", 0),
        ),
    ],
)
def test_what_is_no_integer_is_refused_where_it_is(
    change: dict[str, Any], where: tuple[str | int, ...]
) -> None:
    body = _commit(GOOD)
    body["groups"][1].update(change)
    body["groups"][0]["question_id"] = 4.0  # fine, and not named
    with pytest.raises(ValidationError) as e:
        s.BatchCommit.model_validate(body)
    assert [loc for loc, _ in _errors(e.value)] == [where]


def test_a_frame_body_is_held_to_the_same_rules() -> None:
    commit = s.BatchCommit.model_validate(_commit(GOOD))
    body, payloads = frames.decode(frames.encode_model(commit))
    payloads.check()
    broken = copy.deepcopy(body)
    broken["groups"][1]["rollouts"][2]["reward"] = 0.25
    broken["groups"][2]["rollouts"][0]["text"] = "\x00"
    with pytest.raises(ValidationError) as e:
        s.BatchCommit.model_validate(broken)
    assert [loc for loc, _ in _errors(e.value)] == [
        ("groups", 1, "rollouts", 2, "reward"),
        ("groups", 2, "rollouts", 0, "text"),
    ]
    model = s.BatchCommit.model_validate(body)
    frames.attach(model, payloads)
    assert model.groups[0].rollouts[0]._packed == (s.ids_bytes([1, 2, 3]), s.logprobs_bytes([-0.5] * 3))


def test_packed_bytes_ride_beside_the_fields() -> None:
    r = s.RolloutResult.model_validate(GOOD)
    assert r._packed is None and r.model_dump(exclude_unset=True) == GOOD
    r._packed = (b"\x01\x00\x00\x00", b"\x00\x00\x00\xbf")
    for same in (r.model_copy(), copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert same._packed == r._packed and same == r
    assert r != s.RolloutResult.model_validate(GOOD)  # as with any private value
    assert "_packed" not in r.model_dump() and "_packed" not in r.model_dump_json()
    made = rollout(1.0, [4, 5], [-0.25, -0.5])
    assert made._packed == (s.ids_bytes([4, 5]), s.logprobs_bytes([-0.25, -0.5]))


def test_a_list_of_token_ids_is_refused_at_its_first_wrong_id() -> None:
    """Every id of a full-length list written as a float is taken; in a list that has wrong ids,
    the first is named (not each one: a list can hold 65,536)."""
    n = s.MAX_TOKENS_PER_TRAJECTORY
    fields = {"reward": 1.0, "token_ids": [float(i) for i in range(n)], "logprobs": [-1.0] * n}
    commit = s.BatchCommit.model_validate({"groups": [{"question_id": 1, "rollouts": [fields]}]})
    assert commit.groups[0].rollouts[0].token_ids == list(range(n))
    fields["token_ids"][7] = 7.5
    fields["token_ids"][9] = -1
    with pytest.raises(ValidationError) as e:
        s.BatchCommit.model_validate({"groups": [{"question_id": 1, "rollouts": [fields]}]})
    assert [loc for loc, _ in _errors(e.value)] == [("groups", 0, "rollouts", 0, "token_ids", 7)]


def test_the_whole_request_check_agrees_with_each_rollouts_rules() -> None:
    """A request checks all its rollouts at once (`_rules_hold`) and names the ones that break a
    rule one by one (`_rollout_rules`) only when one does: both say the same of every rollout, any
    reward, text and way of giving (or not) each payload field."""
    import itertools

    fields = ("token_ids", "token_ids_b64", "logprobs", "logprobs_b64")
    values = {"token_ids": [1, 2, 3], "token_ids_b64": IDS, "logprobs": [-0.5] * 3, "logprobs_b64": LPS}
    rollouts = []
    for given in itertools.product([False, True], repeat=len(fields)):
        for reward, text in itertools.product([0.0, 1.0, -0.0, 0.5], [None, "ok", "a\x00"]):
            payload = {f: values[f] for f, g in zip(fields, given, strict=True) if g}
            rollouts.append(s.RolloutResult.model_construct(reward=reward, text=text, **payload))
    kept = [not s._rollout_rules(r, ()) for r in rollouts]
    assert 0 < sum(kept) < len(kept)  # both kinds among them
    assert [s._rules_hold([r]) for r in rollouts] == kept
    good = [r for r, ok in zip(rollouts, kept, strict=True) if ok]
    assert s._rules_hold(good)
    for bad in (r for r, ok in zip(rollouts, kept, strict=True) if not ok):
        assert not s._rules_hold([*good, bad])
