"""A DIN-style ranker (Zhou et al., Deep Interest Network), written as a TorchRec user writes a
model, and served by torchrec-serve through its architecture contract."""
