"""proxmo.bc_loss: the behavior-cloning objective, checked against an independent unpadded
computation (token-by-token log-softmax of a single-sequence forward)."""

import pytest
import torch

import envs
from common.model import load_model_and_tokenizer
from envs.text import PROMPT_WORDS
from proxmo import bc_loss


@pytest.fixture(scope="module")
def model():
    m, _ = load_model_and_tokenizer("tiny-scratch",
                                    vocabulary=envs.vocabulary("household") + PROMPT_WORDS, seed=0)
    return m.eval()


PROMPTS, RESPONSES = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14]]


def token_nlls(model, prompt, response):
    """-log p(token k | tokens < k) for k = 1 .. len(prompt + response) - 1, unpadded."""
    seq = prompt + response
    log_probs = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
    return [-log_probs[k - 1, seq[k]].item() for k in range(1, len(seq))]


def test_bc_loss_is_the_token_mean_response_nll(model):
    with torch.no_grad():
        loss, response_loss = bc_loss(model, PROMPTS, RESPONSES, pad_id=0, prompt_weight=0.0)
        # Response tokens are the last len(r) targets of each sequence; mean over all 4 of them.
        expected = [n for p, r in zip(PROMPTS, RESPONSES)
                    for n in token_nlls(model, p, r)[-len(r):]]
    assert loss.item() == pytest.approx(sum(expected) / 4, abs=1e-5)
    assert response_loss.item() == loss.item()


def test_bc_loss_adds_the_weighted_prompt_nll(model):
    with torch.no_grad():
        loss, response_loss = bc_loss(model, PROMPTS, RESPONSES, pad_id=0, prompt_weight=0.5)
        nlls = [token_nlls(model, p, r) for p, r in zip(PROMPTS, RESPONSES)]
    response = [n for (p, r), seq in zip(zip(PROMPTS, RESPONSES), nlls) for n in seq[-len(r):]]
    # Prompt targets: tokens 2..len(p) of each prompt (the first token has no context): 3 + 1.
    prompt = [n for (p, r), seq in zip(zip(PROMPTS, RESPONSES), nlls) for n in seq[:len(p) - 1]]
    assert len(response) == 4 and len(prompt) == 4
    assert response_loss.item() == pytest.approx(sum(response) / 4, abs=1e-5)
    assert loss.item() == pytest.approx(sum(response) / 4 + 0.5 * sum(prompt) / 4, abs=1e-5)
