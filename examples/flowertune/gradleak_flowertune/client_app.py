"""The ClientApp: trains the adapters it receives on the node's sentences and replies with the adapters."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from gradleak import DefenseMod
from gradleak_flowertune.task import adapter_arrays, build, load_adapters, node_data, train

DEFENSES = {"update_noise": DefenseMod([("update_noise", {"clip": 1.0, "sigma": 0.01})])}  # gradleak


def defense(msg: Message, context: Context, call_next):  # gradleak: the run's defense, as a Flower mod
    chosen = context.run_config["defense"]
    return call_next(msg, context) if chosen == "none" else DEFENSES[chosen](msg, context, call_next)


app = ClientApp(mods=[defense])


@app.train()
def train_adapters(msg: Message, context: Context) -> Message:
    run, node = context.run_config, context.node_config
    model, tokenizer = build(run["model"], int(run["lora-r"]), int(run["lora-alpha"]))
    load_adapters(model, msg.content["arrays"].to_torch_state_dict())
    data = node_data(node["partition-id"], node["num-partitions"], int(run["dataset-size"]), tokenizer,
                     int(run["max-tokens"]))  # fmt: skip
    loss = train(model, data, int(run["local-epochs"]), int(run["batch-size"]), float(run["lr"]))
    metrics = {"train_loss": loss, "num-examples": len(data), "partition-id": node["partition-id"]}
    content = RecordDict({"arrays": ArrayRecord(adapter_arrays(model)), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)
