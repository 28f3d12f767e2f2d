"""Messages that cross a process boundary, and the codec for arrays inside them.

Every process imports this package; it imports nothing heavier than numpy and msgspec.
"""
