"""Coupled Adam (Stollenwerk & Stollenwerk, "Better Embeddings with Coupled Adam", ACL 2025) in
pure torch: fairseq's Adam (AdamW-style decoupled weight decay), except that the rows of each
embedding matrix share one second moment per dimension.

Adam divides every entry's step by the root of that entry's own second moment v. A rare token's
embedding row sees few and small gradients, so its v is small and its steps are large; the push
that the softmax gives every non-target row is then applied with row-dependent step sizes, which
shifts the whole embedding space in one direction (anisotropy). Coupled Adam replaces, for the
denominator only, v_ij of an embedding matrix E (V x d) by s * mean_i v_ij: every row gets the
same step size in dimension j. The stored state stays per entry, as Adam's, so checkpoints have
Adam's keys and shapes.

The update of one parameter at step t (fairseq's ``adam``, ``fairseq/optim/adam.py``; the
coupling only changes ``denominator``)::

    m <- b1 m + (1 - b1) g,  v <- b2 v + (1 - b2) g^2
    denominator = sqrt(v) + eps                          per entry (Adam)
                = sqrt(s * mean over the rows of v) + eps  on the rows of a coupled matrix
    p <- p - lr * wd * p
    p <- p - lr * sqrt(1 - b2^t) / (1 - b1^t) * m / denominator

which is lr * m_hat / (sqrt(s * mean v_hat) + eps / sqrt(1 - b2^t)) in bias-corrected terms:
eps is added where fairseq's adam adds it (docs/coupled_adam.md). fp16/bf16 parameters and
gradients are handled as fairseq's Adam handles them (fp32 state and arithmetic, the result
copied back), so fairseq's ``--memory-efficient-fp16`` wrapper can drive it.
"""
import math
from typing import Iterable, NamedTuple, Tuple, Union

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
# which parameters weight decay reaches: all, or the authors' setting (the matrices other than the
# coupled ones; docs/coupled_adam.md, "Weight decay")
DECAY_CHOICES = ("all", "non-embedding-matrices")


class CoupledBlock(NamedTuple):
    """A V x d embedding matrix stored row-major at element ``offset`` of a parameter: the whole
    parameter (offset 0), or a slice of a flat parameter that holds several tensors (fairseq's
    ``--fp16`` keeps one flat fp32 copy of the model)."""

    offset: int
    rows: int
    cols: int

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The matrix as a (rows, cols) view of ``tensor`` (a parameter or its state), which shares
        its storage."""
        return tensor.view(-1)[self.offset: self.offset + self.rows * self.cols].view(self.rows, self.cols)


Coupled = Union[torch.Tensor, Tuple[torch.Tensor, CoupledBlock]]


def couple_rows_(denominator: torch.Tensor, second_moment: torch.Tensor, block: CoupledBlock, scale: float):
    """Writes sqrt(scale * mean over the rows of ``second_moment``) into every row of ``block`` of
    ``denominator`` (in place; eps is added by the caller, as for the other entries)."""
    shared = block.view(second_moment).mean(dim=0).mul_(scale).sqrt_()
    block.view(denominator).copy_(shared.expand(block.rows, block.cols))


class CoupledAdam(torch.optim.Optimizer):
    """fairseq's Adam with the second moment of the ``coupled`` embedding matrices averaged over
    their rows (the vocabulary) and multiplied by ``coupling_scale`` (s, paper's default 1).

    ``coupled``: the embedding matrices, each a 2-D parameter among ``params`` (coupled whole) or a
    pair (parameter, :class:`CoupledBlock`) for a matrix inside a flat parameter. With nothing
    coupled this is fairseq's Adam, bit for bit. The coupling is not part of the state dict: it is
    given again when the optimizer is built, so a checkpoint of fairseq's ``adam`` loads here and
    the other way round.

    ``undecayed``: parameters, or (parameter, :class:`CoupledBlock`) pairs for tensors inside a
    flat parameter, that ``weight_decay`` does not reach (the authors' setting leaves the token
    embedding and the 1-D parameters undecayed; docs/coupled_adam.md, "Weight decay").
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 coupled: Iterable[Coupled] = (), coupling_scale: float = 1.0, undecayed: Iterable[Coupled] = ()):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if not (math.isfinite(coupling_scale) and coupling_scale > 0):
            raise ValueError(f"coupling_scale must be a finite number > 0, got {coupling_scale}")
        self.coupling_scale = float(coupling_scale)
        self.coupled_blocks = {}  # parameter -> [CoupledBlock]
        for item in coupled:
            param, block = item if isinstance(item, tuple) else (item, None)
            if block is None and param.dim() != 2:
                raise ValueError(f"a coupled matrix must be 2-D (V x d), got shape {tuple(param.shape)}")
            self.coupled_blocks.setdefault(param, []).append(self._block_in(param, block, "a coupled matrix"))
        # ``undecayed``: tensors (or blocks of a flat parameter) that weight decay skips. Torch's
        # parameter groups do that for whole parameters; a block is needed for fairseq's --fp16,
        # whose one flat fp32 parameter holds decayed and undecayed tensors side by side.
        self.undecayed_blocks = {}  # parameter -> [CoupledBlock]
        for item in undecayed:
            param, block = item if isinstance(item, tuple) else (item, None)
            self.undecayed_blocks.setdefault(param, []).append(self._block_in(param, block, "an undecayed tensor"))

    def _block_in(self, param, block, what):
        """``block`` (None: the whole of ``param``, as one matrix), checked to lie in ``param``, an
        optimized parameter."""
        if not any(param is p for group in self.param_groups for p in group["params"]):
            raise ValueError(f"{what} must be one of the optimized parameters")
        if block is None:
            block = CoupledBlock(0, param.shape[0] if param.dim() else 1, param[0].numel() if param.dim() else 1)
        if not param.is_contiguous():
            raise ValueError(f"{what} must be a contiguous tensor")
        if block.offset < 0 or block.offset + block.rows * block.cols > param.numel():
            raise ValueError(f"{block} does not lie in its parameter ({param.numel()} elements)")
        return block

    @property
    def supports_memory_efficient_fp16(self):
        return True

    @property
    def supports_flat_params(self):
        return True  # a matrix inside a flat parameter is a CoupledBlock with its offset

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p, group):
        # The operations and their order are those of fairseq's Adam.step, so that an uncoupled
        # parameter gets exactly fairseq's update.
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("Coupled Adam does not support sparse gradients")
        if grad.dtype in LOW_PRECISION:
            grad = grad.float()
        param = p.data.float() if p.data.dtype in LOW_PRECISION else p.data

        state = self.state[p]
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        else:  # a loaded state follows the parameter's device, in fp32
            state["exp_avg"] = state["exp_avg"].to(param)
            state["exp_avg_sq"] = state["exp_avg_sq"].to(param)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        beta1, beta2 = group["betas"]
        state["step"] += 1

        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = exp_avg_sq.sqrt()
        for block in self.coupled_blocks.get(p, ()):
            couple_rows_(denominator, exp_avg_sq, block, self.coupling_scale)
        denominator.add_(group["eps"])

        bias_correction1 = 1 - beta1 ** state["step"]
        bias_correction2 = 1 - beta2 ** state["step"]
        step_size = group["lr"] * math.sqrt(bias_correction2) / bias_correction1
        skipped = self.undecayed_blocks.get(p, ())
        if group["weight_decay"] != 0 and not any(b.offset == 0 and b.rows * b.cols == p.numel() for b in skipped):
            kept = [block.view(param).clone() for block in skipped]
            param.add_(param, alpha=-group["weight_decay"] * group["lr"])
            for block, values in zip(skipped, kept):  # as if never decayed: the same bits
                block.view(param).copy_(values)
        param.addcdiv_(exp_avg, denominator, value=-step_size)
        if p.data.dtype in LOW_PRECISION:
            p.data.copy_(param)
