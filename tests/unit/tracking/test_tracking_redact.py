"""What keeps credentials out of MLflow, and the tracking config, on their own (no server)."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from lmforge.config.tracking import TrackingConfig
from lmforge.report_html import breakable
from lmforge.tracking.redact import REDACTED, Scrubber, flatten, redact_url, secret_like, truncate
from tests.support.escapes import spelled_out


@pytest.mark.parametrize(
    "key",
    [
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ACCESS_KEY_ID",
        "AWS_SESSION_TOKEN",
        "MLFLOW_TRACKING_TOKEN",
        "MLFLOW_TRACKING_PASSWORD",
        "HF_TOKEN",
        "storage.secret_access_key",
        "launch.env.API_TOKEN",
        "s3.secretKey",
        "db.passwd",
        "gcp.private_key",
        "client.credentials",
    ],
)
def test_keys_that_name_a_credential_are_secret(key):
    assert secret_like(key)


@pytest.mark.parametrize(
    "key",
    [
        "tokenize.eos_token",
        "tokenize.pad_token",
        "tokenize.vocab_size",
        "evaluate.generation.max_new_tokens",
        "distill.chunk_tokens",
        "tokenizer",
        "train.lr",
        "MLFLOW_TRACKING_URI",
        "AWS_DEFAULT_REGION",
        "keyword_filter",
    ],
)
def test_ordinary_config_keys_are_not_secret(key):
    assert not secret_like(key)


def test_the_values_of_secret_env_vars_are_replaced_wherever_they_appear():
    scrub = Scrubber(env={"AWS_SECRET_ACCESS_KEY": "abcdef123456", "RANK": "0", "MY_TOKEN": "tok"})
    assert scrub.text("sig=abcdef123456&x=abcdef123456") == f"sig={REDACTED}&x={REDACTED}"
    assert scrub.text("rank 0, tok") == "rank 0, tok"  # not secrets, and too short to be told apart from text


def test_url_passwords_are_replaced_and_the_rest_of_the_url_kept():
    assert (
        redact_url("see https://me:hunter2@mlflow.example.com/x") == f"see https://me:{REDACTED}@mlflow.example.com/x"
    )
    assert redact_url("s3://bucket/key@v2 and http://host:5000/p") == "s3://bucket/key@v2 and http://host:5000/p"


def test_a_mapping_redacts_secret_keys_learns_their_values_and_cuts_long_ones():
    scrub = Scrubber(env={})
    out = scrub.mapping(
        {"s3.secret_key": "value-from-config-1", "note": "copied value-from-config-1", "long": "x" * 50, "n": 3},
        limit=30,
    )
    assert out["s3.secret_key"] == REDACTED
    assert out["note"] == f"copied {REDACTED}"
    assert len(out["long"]) == 30 and out["long"].endswith("...[50 chars]")
    assert out["n"] == "3"


def test_nested_configs_flatten_to_dotted_keys():
    assert flatten({"train": {"lr": 0.1, "sched": {"kind": "cos"}}, "tags": ["a"], "empty": {}}) == {
        "train.lr": 0.1,
        "train.sched.kind": "cos",
        "tags": ["a"],
        "empty": {},
    }


@given(st.text(max_size=400), st.integers(min_value=30, max_value=200))
def test_truncated_values_always_fit_the_limit(text, limit):
    cut = truncate(text, limit)
    assert len(cut) <= limit
    assert cut == text or len(text) > limit


def test_every_tracking_setting_is_described_and_unknown_keys_are_refused():
    for name, field in TrackingConfig.model_fields.items():
        assert field.description, name
    with pytest.raises(ValidationError):
        TrackingConfig.model_validate({"uri": "http://x"})
    assert TrackingConfig().tracking_uri is None  # off unless configured


AWS_SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfi&CYEXAMPLEKEY"  # the shape of an AWS secret key: '/', '+' and more
_ESCAPINGS = {
    "report.html path": lambda s: breakable(f"s3://corpus/{s}/part-0.jsonl"),
    "HTML numeric references": lambda s: "".join(
        f"&#{ord(c)};" if i % 2 else f"&#x{ord(c):x};" for i, c in enumerate(s)
    ),
    "soft hyphens": lambda s: "\u00ad".join(s),
    "&shy; and zero-width": lambda s: "".join(c + ("&shy;" if i % 2 else "\u200b\u2060") for i, c in enumerate(s)),
    "URL-encoded": lambda s: f"https://h/x?sig={urllib.parse.quote(s, safe='')}",
    "JSON escapes": lambda s: json.dumps({"p": s}).replace("/", "\\/").replace("K", "\\u004b"),
    "JSON of the HTML": lambda s: json.dumps({"html": breakable(s)}, ensure_ascii=True).replace("<", "\\u003c"),
    "HTML of the URL-encoded": lambda s: breakable(urllib.parse.quote(s, safe="")),
}


@pytest.mark.parametrize("form", _ESCAPINGS)
def test_a_secret_is_found_however_the_text_escapes_or_breaks_it(form):
    text = f"before {_ESCAPINGS[form](AWS_SECRET)} after"
    clean = Scrubber(env={"AWS_SECRET_ACCESS_KEY": AWS_SECRET}).text(text)
    assert not spelled_out(clean, AWS_SECRET), clean
    assert clean.startswith("before ") and clean.endswith(" after") and REDACTED in clean


def test_text_around_an_escaped_secret_is_kept_byte_for_byte():
    html_path = breakable(f"s3://corpus/{AWS_SECRET}/part-0.jsonl")
    clean = Scrubber([AWS_SECRET]).text(f"<td>{html_path}</td> &amp; %41 \\n")
    assert clean == f"<td>s3:<wbr>/<wbr>/<wbr>corpus/<wbr>{REDACTED}/<wbr>part-<wbr>0.<wbr>jsonl</td> &amp; %41 \\n"
