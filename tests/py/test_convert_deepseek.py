# Tests (pytest) that convert_hf_to_gguf.py reads the DeepSeek configs of the committed tiny models and refuses,
# in one line naming the file, the DeepSeek settings that llama.cpp's deepseek2 keys cannot express.
import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "py"))
import convert_hf_to_gguf as conv  # noqa: E402


def _config(name: str) -> dict:
    return json.loads((REPO / "tests/data/models" / name / "tiny-f32.ref.json").read_text())["hf_config"]


def test_tiny_configs_read_back():
    v3 = conv.read_hparams(_config("deepseekv3"), Path("config.json"), "DeepseekV3ForCausalLM")
    assert (v3.mla.q_lora_rank, v3.mla.kv_lora_rank, v3.mla.n_group, v3.mla.topk_group) == (32, 32, 4, 2)
    assert v3.mla.yarn["factor"] == 40.0 and v3.n_expert == 8
    lite = conv.read_hparams(_config("deepseekv2lite"), Path("config.json"), "DeepseekV2ForCausalLM")
    assert lite.mla.q_lora_rank is None and lite.mla.n_shared == 2 and lite.mla.yarn is None


@pytest.mark.parametrize("arch,edit,needle", [
    ("DeepseekV2ForCausalLM", {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1},
     "topk_method 'group_limited_greedy' is not supported"),
    ("DeepseekV3ForCausalLM", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ("DeepseekV3ForCausalLM", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                                                   "original_max_position_embeddings": 4096, "mscale": 0.707,
                                                   "mscale_all_dim": 1.0}},
     "YaRN rope parameters"),
    ("DeepseekV3ForCausalLM", {"kv_lora_rank": None}, "missing key 'kv_lora_rank'"),
])
def test_inexpressible_settings_are_one_line_errors(arch, edit, needle):
    config = copy.deepcopy(_config("deepseekv3" if arch == "DeepseekV3ForCausalLM" else "deepseekv2lite"))
    config.update(edit)
    with pytest.raises(conv.ConvertError) as e:
        conv.read_hparams(config, Path("/x/config.json"), arch)
    assert needle in str(e.value) and str(e.value).startswith("/x/config.json: ") and "\n" not in str(e.value)
