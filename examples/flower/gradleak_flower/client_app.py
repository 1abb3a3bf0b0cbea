"""The ClientApp: trains the model it receives on the node's own data and replies with the new weights."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from gradleak import DefenseMod
from gradleak_flower.task import Net, load_data
from gradleak_flower.task import test as test_fn
from gradleak_flower.task import train as train_fn

app = ClientApp(mods=[DefenseMod([("update_noise", {"clip": 1.0, "sigma": 0.01})])])  # gradleak
DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def node_data(context: Context):
    """This node's (train, test) loaders."""
    run, node = context.run_config, context.node_config
    return load_data(node["partition-id"], node["num-partitions"], run["batch-size"], run["dataset-size"])


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = node_data(context)
    lr = msg.content["config"]["lr"]
    loss = train_fn(model, trainloader, context.run_config["local-epochs"], lr, DEVICE)
    metrics = {"train_loss": loss, "num-examples": len(trainloader.dataset)}
    metrics["partition-id"] = context.node_config["partition-id"]  # gradleak, in simulation: whose data
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testloader = node_data(context)
    loss, accuracy = test_fn(model, testloader, DEVICE)
    metrics = {"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(testloader.dataset)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
