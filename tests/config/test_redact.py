from __future__ import annotations

import copy
import json

import pytest

from tmetrics_core.config.schema import load_config
from tmetrics_core.config.redact import MASK, is_secret_key, mask_secrets, redact

WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"
HF_TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"

# key -> is it secret?
KEYS = [
    ("api_key", True),
    ("apikey", True),
    ("apiKey", True),
    ("API-KEY", True),
    ("WANDB_API_KEY", True),
    ("token", True),
    ("HF_TOKEN", True),
    ("HFToken", True),
    ("access_token", True),
    ("password", True),
    ("MLFLOW_TRACKING_PASSWORD", True),
    ("db.passwd", True),
    ("client_secret", True),
    ("AWS_SECRET_ACCESS_KEY", True),
    ("credentials", True),
    ("GOOGLE_APPLICATION_CREDENTIALS", True),
    ("auth", True),
    ("basic_auth", True),
    ("Authorization", True),
    ("private_key", True),
    ("privateKey", True),
    ("tokenizer", False),
    ("max_tokens", False),
    ("layer-expert-tokens", False),
    ("TOKENIZERS_PARALLELISM", False),
    ("author", False),
    ("authority_name", False),
    ("tracking_uri", False),
    ("MLFLOW_TRACKING_USERNAME", False),
    ("PWD", False),
    ("key", False),
    ("keys", False),
    ("experiment", False),
]


@pytest.mark.parametrize(("key", "secret"), KEYS, ids=[k for k, _ in KEYS])
def test_secret_keys(key: str, secret: bool) -> None:
    assert is_secret_key(key) is secret


# text -> masked text
STRINGS = [
    (WANDB_KEY, MASK),
    ("local-" + WANDB_KEY, "local-" + MASK),
    (f"key={WANDB_KEY};", f"key={MASK};"),
    (WANDB_KEY + "0", WANDB_KEY + "0"),  # 41 hex digits: not a W&B key
    ("x" + WANDB_KEY, "x" + WANDB_KEY),  # inside a longer word
    ("0123abcd", "0123abcd"),
    ("postgresql://alice:s3cr3t@db.example:5432/mlflow", f"postgresql://alice:{MASK}@db.example:5432/mlflow"),
    ("https://user:pa%40ss@host/path", f"https://user:{MASK}@host/path"),
    ("https://:onlypass@host", f"https://:{MASK}@host"),
    ("https://host:8080/path", "https://host:8080/path"),
    ("git@github.com:org/repo.git", "git@github.com:org/repo.git"),
    ("sqlite:///runs/mlflow.db", "sqlite:///runs/mlflow.db"),
    ("https://h/p?token=abc123&run=7", f"https://h/p?token={MASK}&run=7"),
    ("https://h/p?run=7&api_key=abc", f"https://h/p?run=7&api_key={MASK}"),
    ("https://h/p?tokenizer=bpe", "https://h/p?tokenizer=bpe"),
    ("Authorization: Bearer eyJhbGciOi.JIUzI1Ni.Isxyz", f"Authorization: Bearer {MASK}"),
    ("bearer abcdefgh12345678", f"bearer {MASK}"),
    ("the bearer of news", "the bearer of news"),
    (f"login with {HF_TOKEN} now", f"login with {MASK} now"),
    ("ghp_" + "a" * 36, MASK),
    ("github_pat_" + "A1_" * 12, MASK),
    ("hf_short", "hf_short"),
    (
        "a\n-----BEGIN RSA PRIVATE KEY-----\nMIIEow\nIBAAK\n-----END RSA PRIVATE KEY-----\nb",
        f"a\n{MASK}\nb",
    ),
    ("layer-grad-l2:100", "layer-grad-l2:100"),
    ("runs/demo", "runs/demo"),
]


@pytest.mark.parametrize(("text", "masked"), STRINGS)
def test_secret_strings(text: str, masked: str) -> None:
    assert mask_secrets(text) == masked


def test_redact_nested_structures_by_key_and_by_value() -> None:
    data = {
        "run": {"name": "demo"},
        "sinks": {
            "wandb": {"project": "p", "api_key": WANDB_KEY, "settings": {"Auth": {"user": "u", "pass": "x"}}},
            "mlflow": {"tracking_uri": "https://bob:hunter2@mlflow.example", "password": None, "token": ""},
            "custom": {"headers": [{"Authorization": "Basic Ym9iOmh1bnRlcjI="}, f"Bearer {WANDB_KEY}"]},
        },
        "tags": ("keep", WANDB_KEY),
        "secret_number": 1234,
        "use_token": True,
        3: "int key",
    }
    original = copy.deepcopy(data)
    assert redact(data) == {
        "run": {"name": "demo"},
        "sinks": {
            "wandb": {"project": "p", "api_key": MASK, "settings": {"Auth": MASK}},
            "mlflow": {"tracking_uri": f"https://bob:{MASK}@mlflow.example", "password": None, "token": ""},
            "custom": {"headers": [{"Authorization": MASK}, f"Bearer {MASK}"]},
        },
        "tags": ("keep", MASK),
        "secret_number": MASK,
        "use_token": True,
        3: "int key",
    }
    assert data == original  # the input is not changed


def test_redact_leaves_non_containers_alone() -> None:
    marker = object()
    assert redact(marker) is marker
    assert redact(3.5) == 3.5
    assert redact(None) is None


def test_a_real_config_logs_without_its_secrets() -> None:
    config = load_config(
        {
            "run": {"name": "demo"},
            "metrics": ["layer-grad-l2:10"],
            "sinks": {
                "wandb": {"project": "demo", "api_key": WANDB_KEY},
                "mlflow": {"tracking_uri": "https://alice:s3cr3t@mlflow.example"},
            },
        }
    )
    logged = json.dumps(redact(config.to_dict()))
    assert WANDB_KEY not in logged
    assert "s3cr3t" not in logged
    assert redact(config.to_dict())["sinks"] == {
        "wandb": {"project": "demo", "api_key": MASK},
        "mlflow": {"tracking_uri": f"https://alice:{MASK}@mlflow.example"},
    }
    assert config.sinks["wandb"]["api_key"] == WANDB_KEY  # the config itself keeps the real key
