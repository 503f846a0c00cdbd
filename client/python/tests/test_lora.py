"""LoRA adapters as refit models (refit.lora, refit.vllm.adapter), with two real refitd nodes.

The trainer (this process, torch 2.x): transformers' own Llama class (a tiny config) whose
linear layers of every decoder layer (q/k/v/o, gate/up/down) carry a hand-written LoRA of rank
16 (peft's layout: `lora_A`, `lora_B`, `lora_alpha`, the original layer as `base_layer`);
only A and B train (SGD on an LM loss). The base model is published once as the refit model
`lora-base`, the adapter as its own refit model `lora-adapter`, a version per training step,
on the trainer's node.

The engine (the same process, the second node): vLLM 0.33's own LlamaForCausalLM built on the
CPU (tests/vllm_models.py), its weights from `lora-base` (Apply into a DESTINATION buffer, then
vLLM's load_weights), and vLLM's own LoRA model manager (LRUCacheLoRAModelManager over the
model: vLLM's LoRA-wrapped layers, its CPU punica wrapper). refit.vllm.adapter loads each
adapter version into a LoRA slot; then every LoRA layer of vLLM's model (fused qkv_proj and
gate_up_proj, o_proj, down_proj, both decoder layers), run through vLLM's LoRA forward on
fixed inputs with the slot mapped to every token, must equal the trainer's layers on the same
inputs (within bf16 rounding: both compute in bf16), and differ from the base model's output.

Bad input, refused before anything is registered or published, the daemon still serving: a
target naming no module of the base model, a rank change between versions of one adapter
model, labels over 1 KiB with the adapter's metadata.
"""

import os
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vllm_models as vm  # noqa: E402  (sets VLLM_TARGET_DEVICE before vLLM is imported)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import refit  # noqa: E402
import refit.lora  # noqa: E402
import refit.testing  # noqa: E402
import refit.torch  # noqa: E402
from refit import vllm as refit_vllm  # noqa: E402
from daemons import two_nodes  # noqa: E402

RANK, ALPHA = 16, 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A linear layer with a LoRA adapter, in peft's layout: y = base(x) + B(A(x)) * alpha/r."""

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, generator):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.Linear(base_layer.in_features, rank, bias=False,
                                dtype=base_layer.weight.dtype)
        self.lora_B = nn.Linear(rank, base_layer.out_features, bias=False,
                                dtype=base_layer.weight.dtype)
        self.lora_alpha = alpha
        self.scaling = alpha / rank
        with torch.no_grad():
            self.lora_A.weight.copy_(torch.randn(self.lora_A.weight.shape, generator=generator)
                                     * 0.05)
            # peft starts B at zero; a small random B makes version 1 differ from the base
            self.lora_B.weight.copy_(torch.randn(self.lora_B.weight.shape, generator=generator)
                                     * 0.05)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model: nn.Module, rank: int, targets=TARGETS, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for path, m in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if leaf in targets and isinstance(m, nn.Linear):
            parent = model.get_submodule(path.rsplit(".", 1)[0])
            setattr(parent, leaf, LoRALinear(m, rank, ALPHA, g))


def trainer_model(rank: int = RANK, seed: int = 0) -> nn.Module:
    """transformers' Llama (tests/vllm_models.py's tiny config) in bf16 with LoRA on every
    linear layer of its decoder layers; the base frozen."""
    import transformers
    cfg = vm.hf_config("llama")
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                  if k != "architectures"})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    for p in model.parameters():
        p.requires_grad_(False)
    add_lora(model, rank)
    return model


def base_name(name: str):
    """The base model's checkpoint names: LoRA matrices left out, peft's `base_layer.` gone."""
    if ".lora_A." in name or ".lora_B." in name:
        return None
    return name.replace(".base_layer.", ".")


def train_step(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vm.VOCAB, (2, 16), generator=g)
    loss = model(input_ids=tokens, labels=tokens).loss
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, grad in zip(params, grads):
            p.sub_(grad * 2.0)


def vllm_engine(max_rank: int = RANK, kind: str = "llama"):
    """vLLM's Llama on the CPU with vLLM's own LoRA model manager over it."""
    from vllm.config import LoRAConfig, set_current_vllm_config
    from vllm.lora.model_manager import LRUCacheLoRAModelManager, create_lora_manager
    cfg = vm.vllm_config(kind)
    cfg.lora_config = LoRAConfig(max_lora_rank=max_rank, max_loras=2, max_cpu_loras=2,
                                 lora_dtype=torch.bfloat16)
    vm.init_tp(cfg)
    model = vm.build(cfg)
    with set_current_vllm_config(cfg):
        manager = create_lora_manager(model, max_num_seqs=4, max_num_batched_tokens=64,
                                      vocab_size=vm.VOCAB, lora_config=cfg.lora_config,
                                      vllm_config=cfg, device=torch.device("cpu"),
                                      lora_manager_cls=LRUCacheLoRAModelManager)
    return cfg, model, manager


def prepare_cpu_gemm(model) -> None:
    """What vLLM's CPU platform does after loading (process_weights_after_loading): picks each
    linear layer's CPU GEMM (layer.cpu_linear)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    for _, m in model.named_modules():
        if isinstance(m, LinearBase):
            dispatch_cpu_unquantized_gemm(m, remove_weight=False)


def lora_forward(cfg, manager, path: str, x: torch.Tensor, lora_id: int) -> torch.Tensor:
    """vLLM's LoRA layer `path` on x, every token mapped to adapter `lora_id` (0: none)."""
    from vllm.config import set_current_vllm_config
    from vllm.lora.layers import LoRAMapping
    with set_current_vllm_config(cfg):
        manager.set_adapter_mapping(LoRAMapping(index_mapping=(lora_id,) * x.shape[0],
                                                prompt_mapping=(lora_id,), is_prefill=True))
        out = manager.modules[path](x)
    return out[0] if isinstance(out, tuple) else out


def model_status(client, model: str):
    for m in client.status().models:
        if m.model == model:
            return m
    return None


class AdapterTest(unittest.TestCase):
    def test_adapter_versions_into_vllm_lora_slots(self):
        trainer_node, engine_node = two_nodes(self, retain=4)
        tc, ec = trainer_node.client(), engine_node.client()
        model = trainer_model()
        base_pub = refit.torch.publisher(tc, "lora-base", model, rename=base_name)
        self.addCleanup(base_pub.release)
        adapter_pub = refit.lora.publisher(tc, "lora-adapter", model, base_model="lora-base")
        self.addCleanup(adapter_pub.release)
        self.assertEqual(adapter_pub.config.rank, RANK)
        self.assertEqual(adapter_pub.config.targets, tuple(sorted(TARGETS)))
        self.assertEqual(len(adapter_pub.names), 2 * 2 * len(TARGETS))
        self.assertTrue(all(n.startswith("base_model.model.model.layers.")
                            for n in adapter_pub.names))

        # The engine: vLLM's model, the base from refit, vLLM's LoRA manager.
        cfg, vmodel, manager = vllm_engine()
        state = {n: t for n, t in ((base_name(k), v) for k, v in model.state_dict().items())
                 if n is not None}
        base_dst = ec.register("lora-base", refit.DESTINATION,
                               {n: torch.zeros_like(t) for n, t in state.items()})
        self.addCleanup(base_dst.release)
        base_pub.publish(1)
        ec.wait_for_version("lora-base", 1, timeout=60)
        ec.apply("lora-base", [base_dst], 1)
        for n, t in state.items():
            self.assertTrue(torch.equal(base_dst.tensors[n], t), n)
        vmodel.load_weights(list(base_dst.tensors.items()))
        prepare_cpu_gemm(vmodel)

        adapter = refit_vllm.adapter(ec, "lora-adapter", manager, lora_id=1)
        self.addCleanup(adapter.release)
        paths = [p for p in manager.modules if p.startswith("model.layers.")]
        self.assertEqual(len(paths), 8)  # qkv_proj, o_proj, gate_up_proj, down_proj x 2
        g = torch.Generator().manual_seed(7)
        inputs = {p: (torch.randn(5, manager.modules[p].base_layer.input_size, generator=g)
                      ).to(torch.bfloat16) for p in paths}
        members = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                   "gate_up_proj": ["gate_proj", "up_proj"]}
        previous = None
        for version in (1, 2, 3):
            if version > 1:
                train_step(model, version)
            adapter_pub.publish(version, labels={"step": version})
            self.assertEqual(adapter.update(version, timeout=60), version)
            self.assertEqual(adapter.labels["step"], str(version))
            self.assertEqual(adapter.labels["lora.rank"], str(RANK))
            self.assertEqual(manager.lora_index_to_id.count(1), 1)  # in one LoRA slot
            outputs, errs, effects = {}, [], []
            for p in paths:
                prefix, leaf = p.rsplit(".", 1)
                with torch.no_grad():
                    want = torch.cat([model.get_submodule(f"{prefix}.{m}")(inputs[p])
                                      for m in members.get(leaf, [leaf])], dim=-1)
                    base = torch.cat([model.get_submodule(f"{prefix}.{m}").base_layer(inputs[p])
                                      for m in members.get(leaf, [leaf])], dim=-1)
                got = lora_forward(cfg, manager, p, inputs[p], 1)
                no_lora = lora_forward(cfg, manager, p, inputs[p], 0)
                err = (got.float() - want.float()).abs().max().item()
                effect = (want.float() - base.float()).abs().max().item()
                scale = want.float().abs().max().item()
                # bit for bit: both sides run torch's bf16 linear, vLLM's punica CPU ops
                # shrink and expand as the trainer's A and B layers do
                self.assertTrue(torch.equal(got, want), f"v{version} {p}: engine differs "
                                f"from the trainer by {err} (adapter effect {effect})")
                self.assertGreater(effect, 20 * err + 1e-3, f"v{version} {p}")
                self.assertLess((no_lora.float() - base.float()).abs().max().item(),
                                scale * 2 ** -6, f"v{version} {p}: the base alone")
                outputs[p] = got
                errs.append(err)
                effects.append(effect)
            print(f"version {version}: engine vs trainer max |diff| {max(errs):.4g}, adapter "
                  f"effect >= {min(effects):.4g} (8 LoRA layers)", file=sys.stderr)
            if previous is not None:  # the new version changed what the engine computes
                self.assertTrue(any(not torch.equal(previous[p], outputs[p]) for p in paths))
            previous = outputs
        status = model_status(ec, "lora-adapter")
        self.assertEqual(status.latest_version, 3)
        # The adapter's DESTINATION buffer holds version 3 as published (vLLM got a copy of
        # B to scale, not the buffer).
        named = dict(model.named_parameters())
        for name, t in adapter.buffer.tensors.items():
            path = name[len("base_model.model."):]
            self.assertTrue(torch.equal(t, named[path]), name)

        # The engine refuses a version whose targets name no LoRA layer of vLLM's model, or
        # whose rank is above max_lora_rank: nothing registered, nothing loaded.
        loaded = set(manager.list_adapters())
        for bad, labels, error in (
                ("lora-bad-target", {"lora.targets": "nope_proj"}, refit.InvalidArgumentError),
                ("lora-bad-rank", {"lora.rank": "32"}, refit.FailedPreconditionError)):
            src = tc.register(bad, refit.SOURCE, {"x": torch.zeros(4)})
            self.addCleanup(src.release)
            tc.publish(bad, 1, [src], labels=dict(adapter_pub.config.labels(), **labels))
            other = refit_vllm.adapter(ec, bad, manager, lora_id=2)
            with self.assertRaises(error) as caught:
                other.update(1, timeout=30)
            self.assertIn("nope_proj" if "targets" in str(labels) else "max_lora_rank",
                          str(caught.exception))
            self.assertIsNone(other.buffer)
            status = model_status(ec, bad)
            self.assertEqual(status.destination_buffers if status else 0, 0)
            self.assertEqual(set(manager.list_adapters()), loaded)


class BadInputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = refit.testing.Daemon(args=["--retain=2"])
        cls.client = cls.daemon.client()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        code = cls.daemon.stop()
        assert code == 0, f"refitd exited with {code}:\n{cls.daemon.log()[-3000:]}"

    def assert_nothing(self, model: str, latest: int = 0):
        status = model_status(self.client, model)
        if status is None:
            self.assertEqual(latest, 0)
            return
        self.assertEqual(status.latest_version, latest)
        self.assertEqual(status.source_buffers, 0)

    def test_target_not_in_base_model(self):
        model = trainer_model()
        with self.assertRaises(refit.InvalidArgumentError) as caught:
            refit.lora.publisher(self.client, "bad-target", model, base_model="b",
                                 targets=list(TARGETS) + ["nope_proj"])
        self.assertIn("'nope_proj' names no module of the base model", str(caught.exception))
        with self.assertRaises(refit.InvalidArgumentError) as caught:
            refit.lora.publisher(self.client, "bad-target", model, base_model="b",
                                 targets=["q_proj"])  # k_proj ... adapted outside the targets
        self.assertIn("match no target", str(caught.exception))
        self.assert_nothing("bad-target")
        self.assertTrue(self.client.status().node)  # still serving

    def test_rank_mismatch_between_versions(self):
        with refit.lora.publisher(self.client, "rank-change", trainer_model(rank=8),
                                  base_model="b") as pub:
            pub.publish(1)
        model16 = trainer_model(rank=16)
        with self.assertRaises(refit.FailedPreconditionError) as caught:
            refit.lora.publisher(self.client, "rank-change", model16, base_model="b")
        self.assertIn("rank 16", str(caught.exception))
        self.assertIn("has rank 8", str(caught.exception))
        self.assert_nothing("rank-change", latest=1)

    def test_metadata_over_the_limit(self):
        with refit.lora.publisher(self.client, "big-labels", trainer_model(),
                                  base_model="b") as pub:
            with self.assertRaises(refit.InvalidArgumentError) as caught:
                pub.publish(1, labels={"note": "x" * 1000})
            self.assertIn("more than the 1024", str(caught.exception))
            status = model_status(self.client, "big-labels")
            self.assertEqual(status.latest_version, 0)
            # the daemon's own check, for a client that skips refit.lora's
            with self.assertRaises(refit.InvalidArgumentError):
                self.client.publish("big-labels", 1, pub.publisher.buffers,
                                    labels=dict(pub.config.labels(), note="x" * 1000))
            self.assertEqual(model_status(self.client, "big-labels").latest_version, 0)
            pub.publish(1, labels={"note": "fits"})
            self.assertEqual(model_status(self.client, "big-labels").latest_version, 1)
        with self.assertRaises(refit.InvalidArgumentError):
            refit.lora.publisher(self.client, "big-base", trainer_model(),
                                 base_model="m" * 1100)
        self.assert_nothing("big-base")


class LabelsRestartTest(unittest.TestCase):
    """Labels (VersionEvent.labels, ModelStatus.version_labels) outlive a SIGKILLed refitd
    with --state-dir, on the trainer's node and on a node that heard them from a peer; an
    adapter's rank with them (refit.lora's rank check still holds after the restart)."""

    def test_labels_survive_a_restart(self):
        import tempfile
        from test_restart import restart
        trainer_dir = tempfile.mkdtemp(prefix="lora-state-t-")
        engine_dir = tempfile.mkdtemp(prefix="lora-state-e-")
        trainer = refit.testing.Daemon(args=["--retain=4", "--node=trainer-node",
                                             f"--state-dir={trainer_dir}"])
        self.addCleanup(trainer.stop)
        port = trainer.client().status().listen_port
        engine = refit.testing.Daemon(args=["--retain=4", "--node=engine-node",
                                            f"--peers=127.0.0.1:{port}",
                                            f"--state-dir={engine_dir}"])
        self.addCleanup(engine.stop)
        tc, ec = trainer.client(), engine.client()
        deadline = time.monotonic() + 20
        while not all(p.connected for p in ec.status().peers):
            self.assertLess(time.monotonic(), deadline, "the daemons did not connect")
            time.sleep(0.05)
        module = trainer_model(rank=8)
        zeros = {}
        for x in refit.lora.find_adapted(module):
            a_name, b_name = refit.lora.peft_names(x.path)
            zeros[a_name], zeros[b_name] = torch.zeros_like(x.a), torch.zeros_like(x.b)
        with refit.lora.publisher(tc, "restart-adapter", module, base_model="b") as pub:
            dst = ec.register("restart-adapter", refit.DESTINATION, zeros)
            for version in (1, 2):
                pub.publish(version, labels={"step": 10 * version, "run": "job-7"})
                ec.wait_for_version("restart-adapter", version, timeout=30)
            dst.release()

        def labels_of(client):
            status = model_status(client, "restart-adapter")
            return {v.version: dict(v.labels) for v in status.version_labels} if status else {}

        before = {"trainer": labels_of(tc), "engine": labels_of(ec)}
        self.assertEqual(before["trainer"][2]["step"], "20")
        self.assertEqual(before["engine"], before["trainer"])
        self.assertEqual(before["engine"][1]["lora.rank"], "8")
        tc.close()
        ec.close()
        restart(trainer)
        restart(engine)
        tc, ec = trainer.client(), engine.client()
        self.addCleanup(tc.close)
        self.addCleanup(ec.close)
        self.assertEqual(labels_of(tc), before["trainer"])
        self.assertEqual(labels_of(ec), before["engine"])
        # The adapter's rank is still known on the trainer's node: rank 16 is refused.
        with self.assertRaises(refit.FailedPreconditionError):
            refit.lora.publisher(tc, "restart-adapter", trainer_model(rank=16),
                                 base_model="b")
        # refitctl drop forgets them (the model's numbers start over), on disk too.
        tc.drop_model("restart-adapter")
        self.assertEqual(labels_of(tc), {})
        restart(trainer)
        tc.close()
        tc = trainer.client()
        self.addCleanup(tc.close)
        self.assertEqual(labels_of(tc), {})
        self.assertEqual(os.listdir(os.path.join(trainer_dir, "labels")), [])


if __name__ == "__main__":
    unittest.main()
