"""What a drafter reads of the target: the hidden states of chosen decoder layers and/or the final-normed
state, captured in the target's own forward pass (target_model/model.py)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class HiddenRequest:
    """Which target hidden states a drafter reads, captured in the target's own forward pass.

    `layers`: outputs of these decoder layers (0-based; negative counts from the end), concatenated in
    that order; then, if `final`, the final-normed hidden state the lm_head scores. The engine hands the
    drafter one array [rows, H * (len(layers) + final)] per pass (see Target.forward)."""

    layers: tuple[int, ...] = ()
    final: bool = True

    def width(self, hidden_size: int) -> int:
        return hidden_size * (len(self.layers) + int(self.final))


FINAL_HIDDEN = HiddenRequest()  # what MTP heads read
