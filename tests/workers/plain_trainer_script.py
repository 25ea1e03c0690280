"""An ordinary Trainer script that knows nothing about hf_flexdemo (for the launcher test).

accelerate launch -m hf_flexdemo.run tests/workers/plain_trainer_script.py --optim flexdemo ...
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from support.tiny_hf import dataset, tiny_model, tokenizer
from transformers import HfArgumentParser, Trainer, TrainingArguments, default_data_collator, set_seed


@dataclass
class ModelArguments:
    model_kind: str = field(default="llama")


def main():
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)
    tok = tokenizer()
    model = tiny_model(model_args.model_kind, len(tok))
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset(model_args.model_kind, tok),
        data_collator=default_data_collator,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        report = {"optimizer": type(trainer.optimizer.optimizer).__name__, "log_history": trainer.state.log_history}
        Path(training_args.output_dir, "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
