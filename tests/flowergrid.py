"""Flower's Grid over ClientApps called in this process (no SuperLink, no Ray), for tests that drive a
strategy through Flower's own round loop (imported as ``flowergrid``, a name no other test module has)."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, Metadata, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

ClientFn = Callable[[Message, Context], Message]


class AppGrid(Grid):
    """Each message goes to ``apps[node]`` with ``partition-id`` = the node's index in ``nodes``; a
    raising ClientApp becomes an error reply, as Flower's runtime makes it."""

    def __init__(self, apps: dict[int, ClientFn], nodes: tuple[int, ...] | None = None) -> None:
        self.apps = apps
        self.nodes = tuple(nodes or sorted(apps))
        self.sent: list[Message] = []

    @property
    def run(self):  # type: ignore[override]
        raise NotImplementedError

    def set_run(self, run):  # noqa: D102
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(
            content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl
        )

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            ctx = Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": self.nodes.index(node)},
                state=RecordDict(),
                run_config={},
            )
            try:
                replies.append(self.apps[node](msg, ctx))
            except Exception as exc:  # what Flower's runtime does with a raising ClientApp
                replies.append(Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg))
        return replies


@contextlib.contextmanager
def server_identity(seed: int = 0) -> Iterator[None]:
    """What Flower's ServerApp process sets before a strategy builds messages, with Python's global random
    seeded (Flower's FedAvg samples nodes with it); both restored after."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    state = random.getstate()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    random.seed(seed)
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
        random.setstate(state)


def train_message(
    state: Mapping[str, torch.Tensor],
    *,
    node: int,
    group: str = "3",
    config: Mapping[str, Any] | None = None,
    message_type: str = MessageType.TRAIN,
) -> Message:
    """A train (or other) message to ``node`` carrying ``state`` as its one ArrayRecord, as Flower's
    message API sends it."""
    metadata = Metadata(
        run_id=1, message_id="m1", src_node_id=1, dst_node_id=node, reply_to_message_id="", group_id=group,
        created_at=time.time(), ttl=600.0, message_type=message_type,
    )  # fmt: skip
    content = RecordDict(
        {"arrays": ArrayRecord(torch_state_dict=dict(state)), "config": ConfigRecord(dict(config or {}))}
    )
    return Message(content, metadata=metadata)


def node_context(node: int, node_config: Mapping[str, Any] | None = None) -> Context:
    """A ClientApp's context on ``node``."""
    return Context(
        run_id=1, node_id=node, node_config=dict(node_config or {}), state=RecordDict(), run_config={}
    )
