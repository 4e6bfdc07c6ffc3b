"""The KVSlot actor's record of the tokens whose KV its slot holds, through its inbox."""

import trio

from motet.actors.kv_slot import Claim, Extend, KVSlot, Release, SetHistory
from motet.runtime.actor import open_reply


async def ask(slot: KVSlot, message_of):
    send, receive = open_reply()
    await slot.inbox.send.send(message_of(send))
    return await receive.receive()


async def test_a_slot_keeps_the_tokens_it_is_extended_by_and_gives_them_back_as_a_tuple():
    async with trio.open_nursery() as nursery:
        slot = KVSlot(0)
        await nursery.start(slot.run)
        assert await ask(slot, lambda reply: Claim((1, 2, 3), reply)) == 0
        await slot.inbox.send.send(Extend((1, 2, 3)))
        for token in range(4, 2004):  # a decode step's token at a time
            await slot.inbox.send.send(Extend((token,)))
        held = await ask(slot, Release)
        assert held == (1, 2, 3, *range(4, 2004))
        assert isinstance(held, tuple)
        nursery.cancel_scope.cancel()


async def test_a_claim_keeps_the_shared_prefix_and_drops_the_rest():
    async with trio.open_nursery() as nursery:
        slot = KVSlot(0)
        await nursery.start(slot.run)
        await slot.inbox.send.send(SetHistory((5, 6, 7, 8, 9)))
        # the prompt shares 5, 6, 7; its last token always runs again
        assert await ask(slot, lambda reply: Claim((5, 6, 7, 1, 2), reply)) == 3
        await slot.inbox.send.send(Extend((1, 2)))
        assert await ask(slot, Release) == (5, 6, 7, 1, 2)
        assert await ask(slot, lambda reply: Claim((5, 6), reply)) == 1  # a prompt inside the history
        assert await ask(slot, Release) == (5,)
        await slot.inbox.send.send(SetHistory(()))  # erased
        assert await ask(slot, Release) == ()
        nursery.cancel_scope.cancel()
