"""The Ray tests' shared fixtures: one local Ray cluster for all of tests/ray (2 CPUs: one per
replica; no dashboard), and the tiny random model with a tokenizer and a chat template."""
import shutil

import pytest

TEMPLATE = ("{% for m in messages %}w1 {{ m['content'].strip() }} {% endfor %}"
            "{% if add_generation_prompt %}w2{% endif %}")


@pytest.fixture(scope="package")
def cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="package")
def model_dir(tiny_checkpoint, tmp_path_factory):
    """The tiny random Llama (vocabulary 300) with a word tokenizer (w1..w299 are ids 1..299) whose
    chat template renders each message as "w1 <content>" and the generation prompt as "w2"."""
    from tests.helpers import make_tokenizer

    path = tmp_path_factory.mktemp("ray_model")
    for f in tiny_checkpoint.iterdir():
        shutil.copy(f, path)
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path
