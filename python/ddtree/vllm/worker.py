"""DDTree's vLLM worker: vLLM's GPU worker building DDTree's model runner.

Selected by the plugin's config translation (``worker_cls``); everything but
the runner class is vLLM's.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from ddtree.vllm.patches import apply_worker_patches, runner_class_swapped


#: vLLM 0.33's worker builds its runner in this method, which subclasses override; 0.25.1's imports the class inside
#: ``init_device`` (patch 4 swaps it there).
RUNNER_FACTORY = "_make_model_runner"


class DDTreeWorker(Worker):
    def init_device(self):
        if self.vllm_config.use_v2_model_runner:
            raise RuntimeError("DDTree runs on vLLM's V1 model runner; set VLLM_USE_V2_MODEL_RUNNER=0")
        apply_worker_patches(self.vllm_config)
        if hasattr(Worker, RUNNER_FACTORY):
            return super().init_device()
        with runner_class_swapped():
            return super().init_device()

    def _make_model_runner(self):
        """vLLM 0.33's factory: DDTree's runner (the V1 runner's subclass)."""
        from ddtree.vllm.runner import DDTreeGPUModelRunner

        return DDTreeGPUModelRunner(self.vllm_config, self.device)

    def compile_or_warm_up_model(self):
        out = super().compile_or_warm_up_model()
        # The drafter's packed top-K kernel compiled now, not in the first request's step.
        self.model_runner.ddtree_warm_up()
        return out

    def ddtree_summary(self):
        return self.model_runner.ddtree_summary()

    def ddtree_host_pieces(self, on: bool = True):
        return self.model_runner.ddtree_host_pieces(on)

    def ddtree_host_profile_start(self):
        return self.model_runner.ddtree_host_profile_start()

    def ddtree_host_profile_stop(self, limit: int = 40):
        return self.model_runner.ddtree_host_profile_stop(limit)
