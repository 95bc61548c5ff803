import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

torch.set_num_threads(1)

#: A small, fixed slice of the stdlib: enough text for a BPE of a few hundred tokens.
TINY_PREFIXES = ("json/", "html/", "email/_", "collections/", "logging/")


@pytest.fixture(scope="session")
def tiny_docs():
    from ddtree.training import data

    try:
        root = data.find_stdlib()
    except FileNotFoundError:
        import sysconfig

        root = sysconfig.get_paths()["stdlib"]
    docs = [d for d in data.iter_documents(root) if d[0].startswith(TINY_PREFIXES)]
    if len(docs) < 10:
        pytest.skip(f"stdlib at {root} has too few files for the tiny corpus")
    return docs


@pytest.fixture(scope="session")
def tiny_data(tiny_docs, tmp_path_factory):
    from ddtree.training import data

    out = str(tmp_path_factory.mktemp("data"))
    data.prepare(out, vocab_size=320, heldout_fraction=0.2, num_prompts=2, prompt_length=24, docs=tiny_docs)
    return data.load(out)


@pytest.fixture(scope="session")
def tiny_pair(tiny_data):
    """A fresh tiny target (bf16-rounded, fp32) and drafter, from the pipeline's tiny shapes."""
    from ddtree.training import model, pipeline

    target_shape, drafter_shape = pipeline.tiny_shapes()
    config = model.target_text_config(target_shape, tiny_data.vocab_size, tiny_data.eos_id, tiny_data.pad_id)
    target = model.new_target(config, seed=0).eval()
    model.round_to_bf16_(target)
    drafter = model.new_drafter(config, drafter_shape, tiny_data.mask_id, seed=0).eval()
    return config, target, drafter
