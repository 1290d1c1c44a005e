"""The input processor actor on its streams, without an engine: submissions in, `AddRequest`s out in
order (aborts and utility calls never overtake an add), a bad submission answered with its error
while the others go on, and a long prompt tokenized off the event loop. The tokenizer is the default
model's; the expected token ids come from calling it directly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from troupe.actors.input_processor import FrontendInput, InputProcessor, Submission
from troupe.actors.requests import RequestTable
from troupe.errors import InvalidInputError
from troupe.inputs import ModelLimits
from troupe.messages import AbortRequest, AddRequest, EngineInput, UtilityCall
from troupe.sampling_params import SamplingParams

LIMITS = ModelLimits(vocab_size=49152, max_model_len=64, eos_token_ids=(2,))


class Processor:
    """The actor running; the test holds the inbox's send end and the outbox's receive end."""

    def __init__(self, actor: InputProcessor, table: RequestTable, inbox: MemoryObjectSendStream[FrontendInput],
                 outbox: MemoryObjectReceiveStream[EngineInput]) -> None:
        self.actor, self.table, self.inbox, self.outbox = actor, table, inbox, outbox

    async def submit(self, external_id: str, prompt: Any, **params: Any) -> Submission:
        sub = Submission(external_id, SamplingParams(**params), prompt=prompt)
        await self.inbox.send(sub)
        return sub


@asynccontextmanager
async def running(tokenizer: Any, **options: Any) -> AsyncIterator[Processor]:
    table = RequestTable(tokenizer)
    to_actor, inbox = anyio.create_memory_object_stream[FrontendInput](16)
    outbox, from_actor = anyio.create_memory_object_stream[EngineInput](16)
    actor = InputProcessor(tokenizer, LIMITS, table, inbox, outbox, **options)
    with anyio.fail_after(30):
        async with to_actor, from_actor, anyio.create_task_group() as tg:
            await tg.start(actor.run)
            yield Processor(actor, table, to_actor, from_actor)
            tg.cancel_scope.cancel()


async def test_submissions_become_adds_in_order_and_aborts_never_overtake_them(tokenizer: Any) -> None:
    """Text and token-id prompts go out as `AddRequest`s in the order submitted, each with the
    tokenizer's ids and its own internal id; the abort and utility call sent after them come after
    them; each submission is answered with its registered stream."""
    async with running(tokenizer) as p:
        a = await p.submit("a", "hello world", max_tokens=3)
        b = await p.submit("b", {"prompt_token_ids": [5, 6, 7]}, max_tokens=4)
        await p.inbox.send(AbortRequest(["a-internal"]))
        await p.inbox.send(UtilityCall(9, "echo", [1]))
        got = [await p.outbox.receive() for _ in range(4)]
        assert [type(m) for m in got] == [AddRequest, AddRequest, AbortRequest, UtilityCall]
        add_a, add_b = got[0], got[1]
        assert isinstance(add_a, AddRequest) and isinstance(add_b, AddRequest)
        assert add_a.external_id == "a" and add_a.prompt_token_ids == tokenizer("hello world")["input_ids"]
        assert add_b.external_id == "b" and add_b.prompt_token_ids == [5, 6, 7] and add_b.max_tokens == 4
        assert add_a.request_id.startswith("a-") and add_a.request_id != add_b.request_id
        assert (await a.reply.wait()) is not None and (await b.reply.wait()) is not None
        assert p.table.num_unfinished == 2
        assert p.actor.statistics() == (2, 0, 0)


async def test_a_bad_submission_is_answered_with_its_error_and_the_next_goes_on(tokenizer: Any) -> None:
    """A prompt longer than the model's context and a token id outside the vocabulary are each
    answered with an `InvalidInputError` naming the field; nothing of theirs reaches the engine, and
    the submission after them does."""
    async with running(tokenizer) as p:
        too_long = await p.submit("long", {"prompt_token_ids": [5] * 80})
        bad_token = await p.submit("tok", {"prompt_token_ids": [5, 49152]})
        fine = await p.submit("fine", {"prompt_token_ids": [5]}, max_tokens=2)
        with pytest.raises(InvalidInputError) as long_error:
            await too_long.reply.wait()
        with pytest.raises(InvalidInputError) as token_error:
            await bad_token.reply.wait()
        assert long_error.value.field == "prompt" and "context of 64 tokens" in str(long_error.value)
        assert token_error.value.field == "prompt_token_ids" and "token id 49152" in str(token_error.value)
        sent = await p.outbox.receive()
        assert isinstance(sent, AddRequest) and sent.external_id == "fine"
        await fine.reply.wait()
        assert p.actor.statistics() == (1, 0, 2) and p.table.num_unfinished == 1


async def test_a_long_prompt_is_tokenized_off_the_loop_while_a_short_one_passes(tokenizer: Any) -> None:
    """A prompt over `offload_chars` is tokenized in a worker thread in its own task (counted as
    offloaded); the short one after it is handled inline; both come out with the tokenizer's ids."""
    long_text = "the quick brown fox " * 3
    async with running(tokenizer, offload_chars=16) as p:
        slow = await p.submit("slow", long_text, max_tokens=1)
        quick = await p.submit("quick", "hi", max_tokens=1)
        got = {}
        for _ in range(2):
            msg = await p.outbox.receive()
            assert isinstance(msg, AddRequest)
            got[msg.external_id] = msg.prompt_token_ids
        assert got == {"slow": tokenizer(long_text)["input_ids"], "quick": tokenizer("hi")["input_ids"]}
        await slow.reply.wait()
        await quick.reply.wait()
        assert p.actor.statistics() == (2, 1, 0)
