"""A Hugging Face `TrainerCallback` that publishes the model to refit after every optimizer step:

    import refit, refit.hf
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[refit.hf.PublishCallback(refit.Client(), "policy")])
    trainer.train()                      # versions 1, 2, ... = the trainer's global steps

Works with every `transformers.Trainer` subclass, TRL's trainers (GRPOTrainer, ...) included,
since they call the same callback events. The publisher (`refit.torch.publisher`) is made at
`on_train_begin` from the model the trainer trains (sharded by then, under FSDP2 through
accelerate), each `on_step_end` (after the optimizer step) publishes `global_step + offset`,
and `on_train_end` releases it. Needs transformers (imported here, not by `import refit`).
"""

from typing import Optional

from transformers import TrainerCallback

import refit.torch as refit_torch


class PublishCallback(TrainerCallback):
    """Publishes `model_name` after every optimizer step of a transformers Trainer.

    `version_offset` is added to the trainer's global step (a resumed run whose versions must
    keep increasing); `every` publishes every N-th step only; the rest of the keywords go to
    `refit.torch.publisher` (`rename=`, `group=`, ...).
    """

    def __init__(self, client, model_name: str, *, version_offset: int = 0, every: int = 1,
                 **publisher_kwargs):
        if every < 1:
            raise ValueError("every must be >= 1")
        self.client = client
        self.model_name = model_name
        self.version_offset = version_offset
        self.every = every
        self.publisher_kwargs = publisher_kwargs
        self.publisher: Optional[refit_torch.Publisher] = None
        self.published = []  # (version, bytes) of this rank, in order

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("refit.hf.PublishCallback: the trainer passed no model")
        self.publisher = refit_torch.publisher(self.client, self.model_name, model,
                                               **self.publisher_kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.publisher is None or state.global_step % self.every:
            return
        version = state.global_step + self.version_offset
        # Provenance: the engines see which training step made the version (event.labels).
        response = self.publisher.publish(version, labels={"step": str(state.global_step)})
        self.published.append((version, response.bytes if response is not None else 0))

    def on_train_end(self, args, state, control, **kwargs):
        if self.publisher is not None:
            self.publisher.release()
            self.publisher = None
