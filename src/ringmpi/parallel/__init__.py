"""Work spread over ranks: the ring (neighbours, channels, deadlines), its schedule and passes, the
head x ring schedule, topology (docs/design.md)."""
