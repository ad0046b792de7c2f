"""A loss of your own, trained from the command line.

``SymmetricInfoNCE`` scores in both directions: each anchor picks its positive among
every document of the batch (positives and hard negatives), and each positive picks its
anchor among every anchor; the loss is the mean of the two cross-entropies.

Train with it (this folder on ``PYTHONPATH``)::

    PYTHONPATH=examples mmembed sft --loss_type custom_loss:SymmetricInfoNCE \\
        --loss_kwargs '{"temperature": 0.05}' --model ... --dataset ...

or register a name first (``register_loss("symmetric_infonce", SymmetricInfoNCE)``) in
Python and pass ``loss_type="symmetric_infonce"`` to ``mmembed.train``.
"""

import torch
import torch.nn.functional as F

from mmembed.losses import EmbeddingLoss, as_groups


class SymmetricInfoNCE(EmbeddingLoss):
    """Anchor -> documents and positive -> anchors cross-entropy, averaged.

    Declares nothing beyond the base class: the group layout, no side inputs, and under
    several processes the loss is computed on the whole gathered batch.
    """

    def __init__(self, temperature: float = 0.05):
        super().__init__()
        self.temperature = temperature

    def forward(self, outputs, labels):
        emb = outputs["last_hidden_state"]
        groups = as_groups(labels, emb.shape[0], emb.device)  # already split by the trainer
        anchors, positives = emb[groups.anchor], emb[groups.positive]
        documents = torch.cat([positives, emb[groups.negative]])
        target = torch.arange(groups.n_groups, device=emb.device)
        to_documents = F.cross_entropy(anchors @ documents.T / self.temperature, target)
        to_anchors = F.cross_entropy(positives @ anchors.T / self.temperature, target)
        return (to_documents + to_anchors) / 2
