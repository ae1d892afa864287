"""Rows of datasets in their hub schemas."""

from __future__ import annotations

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "A shop sells 1,250 pens a day. How many in 2 days?",
        "answer": "1,250 * 2 = <<1250*2=2500>>2,500\n#### 2,500",
    },
]
