"""The ClientApp: FedAvg local training through a gradleak defense (``gradleak.defend``).

The defense sits in the training loop itself (``defend`` wraps the model and the optimizer, the way Opacus'
``make_private`` does); the reply is ``loop.weights()``, ``w_0`` plus the defended update. If the defense
fails, ``defend`` raises: the node sends nothing and Flower reports the error to the server.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.nn import functional as F

from gradleak.defenses.in_loop import defend
from gradleak_flower.task import component, model, node_data, training

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    run = context.run_config
    k, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    data = node_data(k, n, int(run["train-limit"]), int(run["seed"]))
    recipe = training(run)
    net = model()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loop = defend(
        net, lambda params: torch.optim.SGD(params, lr=recipe.lr),
        [component(run, "defense")], data=data,
    )  # fmt: skip
    for _ in range(recipe.epochs):
        for idx in torch.randperm(len(data)).split(recipe.batch_size):
            loop.optimizer.zero_grad()
            F.cross_entropy(net(data.images[idx]), data.labels[idx]).backward()
            loop.optimizer.step()  # the defense's per-step hooks run first
        loop.end_epoch()
    # w_0 + the defended update (w_T - w_0 through the defense's on_update, validated)
    reply = RecordDict({
        "arrays": ArrayRecord(torch_state_dict=loop.weights(len(data))),
        "metrics": MetricRecord({"num-examples": len(data)}),
    })  # fmt: skip
    return Message(reply, reply_to=msg)
