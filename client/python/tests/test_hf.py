"""refit.hf.PublishCallback in a real transformers Trainer (and TRL's GRPOTrainer when it builds
here): a tiny Qwen3 from a config, a few AdamW steps on the CPU, one version per optimizer step;
an engine on the same refitd applies every version afterwards (--retain keeps them) and must
hold, bit for bit, the weights the trainer had right after that step.

Run by Bazel (//client/python:hf_test) in the test environment.
"""

import os
import sys
import tempfile
import unittest

import torch

import refit
import refit.hf
import refit.testing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_trainer  # noqa: E402

STEPS = 3


class Snapshots:
    """A callback recording the weights after each step (the test's reference)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Recorder(TrainerCallback):
            def __init__(self):
                self.weights = {}

            def on_step_end(self, args, state, control, model=None, **kwargs):
                self.weights[state.global_step] = {
                    k: v.detach().clone() for k, v in model.state_dict().items()}
        return Recorder()


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, length: int = 12):
        g = torch.Generator().manual_seed(7)
        self.rows = torch.randint(0, torch_trainer.VOCAB, (n, length), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class HfTrainerTest(unittest.TestCase):
    def setUp(self):
        self.daemon = refit.testing.Daemon(args=["--retain=8"])
        self.addCleanup(self.daemon.stop)
        self.client = self.daemon.client()
        self.out = tempfile.mkdtemp(prefix="refit-hf-")

    def check_versions(self, model_name: str, weights):
        shapes = {k: tuple(v.shape) for k, v in weights[STEPS].items()}
        dst = self.client.register(model_name, refit.DESTINATION,
                                   {k: torch.zeros(s) for k, s in shapes.items()})
        self.addCleanup(dst.release)
        for version in range(1, STEPS + 1):
            self.assertEqual(self.client.apply(model_name, [dst], version).version, version)
            for name, want in weights[version].items():
                self.assertTrue(torch.equal(dst.tensors[name], want),
                                f"version {version}: {name} differs")
        # the weights moved between versions: each was a real step
        q = "model.layers.0.self_attn.q_proj.weight"
        self.assertFalse(torch.equal(weights[1][q], weights[STEPS][q]))

    def test_trainer_publishes_every_optimizer_step(self):
        from transformers import Trainer, TrainingArguments
        model = torch_trainer.build("qwen3")
        publish = refit.hf.PublishCallback(self.client, "hf-tiny")
        recorder = Snapshots()
        args = TrainingArguments(output_dir=self.out, max_steps=STEPS,
                                 per_device_train_batch_size=4, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=TokenData(),
                          callbacks=[publish, recorder])
        trainer.train()
        self.assertEqual([v for v, _ in publish.published], list(range(1, STEPS + 1)))
        self.assertTrue(all(b > 0 for _, b in publish.published))
        self.assertIsNone(publish.publisher)  # released at on_train_end
        self.check_versions("hf-tiny", recorder.weights)

    def test_trl_grpo_trainer_publishes_every_optimizer_step(self):
        """TRL's GRPOTrainer (installed trl: generation, rewards, its own loss) with the same
        callback: a word-level tokenizer made here, a reward function, no vLLM."""
        from datasets import Dataset
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from trl import GRPOConfig, GRPOTrainer
        vocab = {f"t{i}": i for i in range(torch_trainer.VOCAB - 3)}
        vocab.update({"<pad>": 98, "<eos>": 99, "<unk>": 100})
        words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>",
                                            eos_token="<eos>", unk_token="<unk>")
        model = torch_trainer.build("qwen3")
        model.config.pad_token_id, model.config.eos_token_id = 98, 99
        prompts = Dataset.from_dict({"prompt": ["t1 t2 t3", "t4 t5", "t6 t7 t8", "t9"] * 4})

        def reward(completions, **kwargs):
            return [float(len(c)) for c in completions]

        publish = refit.hf.PublishCallback(self.client, "grpo-tiny")
        recorder = Snapshots()
        args = GRPOConfig(output_dir=self.out, max_steps=STEPS, per_device_train_batch_size=2,
                          num_generations=2, max_completion_length=4, learning_rate=1e-2,
                          report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                              train_dataset=prompts, processing_class=tokenizer,
                              callbacks=[publish, recorder])
        trainer.train()
        self.assertEqual([v for v, _ in publish.published], list(range(1, STEPS + 1)))
        self.check_versions("grpo-tiny", recorder.weights)


if __name__ == "__main__":
    unittest.main(verbosity=2)
