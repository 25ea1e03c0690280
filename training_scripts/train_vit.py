"""Fine-tune (or train from its config) a ViT image classifier with FlexDeMo.

    # Offline, on one CPU machine as 2 simulated nodes x 2 processes:
    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml training_scripts/train_vit.py --preset offline
    # The AdamW-HSDP baseline on the same data and model:
    accelerate launch --config_file accelerate_configs/cpu_2x2.yaml training_scripts/train_vit.py \
        --preset offline --optim adamw_torch --output_dir outputs/vit-offline-adamw

    # ViT-Base on CIFAR-10 (the paper's set-up), 2 GPU nodes x 8; run on every node:
    accelerate launch --config_file accelerate_configs/flexdemo.yaml \
        --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR \
        training_scripts/train_vit.py --bf16

Every `TrainingArguments` flag works; `--optim flexdemo` is the default. The offline preset
trains a tiny ViT built from a config on scikit-learn's handwritten digits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import evaluate
import numpy as np
import torch
from datasets import ClassLabel, Dataset, Features, Image, load_dataset
from offline_data import digit_images, split
from PIL import Image as PILImage
from script_utils import (
    ScriptArguments,
    ScriptTrainerMixin,
    card_info,
    exit_worker,
    hub_errors,
    hub_model,
    limit_samples,
    parse_arguments,
    train_and_report,
)
from transformers import (
    AutoImageProcessor,
    AutoModelForImageClassification,
    Trainer,
    TrainingArguments,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
)

METRIC = str(Path(__file__).resolve().parent / "metrics" / "accuracy.py")


@dataclasses.dataclass
class ViTArguments(ScriptArguments):
    model_name_or_path: str = "google/vit-base-patch16-224-in21k"
    dataset_name: str = "uoft-cs/cifar10"
    image_column: str = "img"
    label_column: str = "label"
    eval_fraction: float = 0.1
    image_size: int = dataclasses.field(default=16, metadata={"help": "offline: digits are resized to this."})
    hidden_size: int = dataclasses.field(default=64, metadata={"help": "offline: model width."})
    num_layers: int = dataclasses.field(default=2, metadata={"help": "offline: encoder layers."})


COMMON = dict(remove_unused_columns=False, eval_strategy="no")
PRESETS = {
    "hub": dict(
        output_dir="outputs/vit-cifar10", learning_rate=1e-4, num_train_epochs=3, per_device_train_batch_size=32
    ),
    "offline": dict(
        output_dir="outputs/vit-offline",
        learning_rate=2e-3,
        num_train_epochs=30,
        per_device_train_batch_size=32,
    ),
}


def load_images(args: ViTArguments, seed: int):
    """(train, validation) datasets with "image" (PIL) and "label" (ClassLabel) columns."""
    if args.offline:
        images, labels = digit_images()
        features = Features({"image": Image(), "label": ClassLabel(names=[str(d) for d in range(10)])})
        data = Dataset.from_dict(
            {"image": [PILImage.fromarray(im) for im in images], "label": labels.tolist()}, features=features
        )
        return split(data, args.eval_fraction * 2, seed)
    raw = load_dataset(args.dataset_name)
    raw = raw.rename_columns({args.image_column: "image", args.label_column: "label"})
    if "validation" not in raw:
        raw["validation"] = (
            raw.pop("test") if "test" in raw else split(raw["train"], args.eval_fraction, seed)["validation"]
        )
    return raw


def build_model_and_processor(args: ViTArguments, labels: list[str]):
    id2label = dict(enumerate(labels))
    label2id = {name: i for i, name in id2label.items()}
    label_maps = {"id2label": id2label, "label2id": label2id}
    if args.offline:
        config = ViTConfig(
            image_size=args.image_size,
            patch_size=4,
            num_channels=3,
            hidden_size=args.hidden_size,
            num_hidden_layers=args.num_layers,
            num_attention_heads=4,
            intermediate_size=4 * args.hidden_size,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            id2label=id2label,
            label2id=label2id,
        )
        processor = ViTImageProcessor(size={"height": args.image_size, "width": args.image_size})
        return ViTForImageClassification(config), processor
    processor = AutoImageProcessor.from_pretrained(args.model_name_or_path)
    extra = {} if args.from_config else {"ignore_mismatched_sizes": True}  # a new classification head
    return hub_model(AutoModelForImageClassification, args, num_labels=len(labels), **extra, **label_maps), processor


class ClassificationTrainer(ScriptTrainerMixin, Trainer):
    pass


def collate(examples):
    return {
        "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
        "labels": torch.tensor([e["label"] for e in examples]),
    }


def main() -> None:
    args, training_args = parse_arguments((ViTArguments, TrainingArguments), PRESETS, COMMON)
    with training_args.main_process_first(desc="loading data"):
        data = load_images(args, training_args.seed)
    limit_samples(data, args)
    labels = data["train"].features["label"].names
    model, processor = build_model_and_processor(args, labels)

    def transform(batch):
        pixels = processor([im.convert("RGB") for im in batch["image"]], return_tensors="pt")["pixel_values"]
        return {"pixel_values": list(pixels), "label": batch["label"]}

    data.set_transform(transform)
    metric = evaluate.load(METRIC)

    def compute_metrics(prediction):
        return metric.compute(predictions=np.argmax(prediction.predictions, axis=1), references=prediction.label_ids)

    with hub_errors(training_args):
        trainer = ClassificationTrainer(
            model=model,
            args=training_args,
            train_dataset=data["train"],
            eval_dataset=data["validation"],
            processing_class=processor,
            data_collator=collate,
            compute_metrics=compute_metrics,
        )
    dataset = "scikit-learn's handwritten digits (8x8)" if args.offline else args.dataset_name
    trainer.card_info = card_info(
        args,
        f"a ViT image classifier over {len(labels)} classes",
        f"{dataset} ({len(data['train'])} training images, {len(data['validation'])} held out).",
        ["image-classification", "vit"],
    )
    train_and_report(trainer, ["eval_loss", "eval_accuracy"])


if __name__ == "__main__":
    main()
    exit_worker()  # after a distributed job: no teardown for gloo's threads to abort in
