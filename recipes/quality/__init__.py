"""What only the Crowd-BT quality recipe needs: `data` (the reader of the original's per-annotator
comparison files, truth.json, the split and the dataset of pairs), `model` (the timm scorer with
its annotator reliabilities) and `example` (synthetic degraded images and annotators)."""
