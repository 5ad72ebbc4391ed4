"""Price plans: what a tenant pays per token kind, per hosted adapter and at least per month.

Money is ``Decimal`` throughout. Prices are accepted as decimal strings, ints or
``Decimal``; floats are refused because their binary noise (0.1 -> 0.1000000000000000055...)
would leak into invoices.

Volume tiers (graduated): each token kind is tiered by the month's volume of that kind.
The plan's own prices cover tokens ``[0, tiers[0].from_tokens)``; tier ``i`` prices the
tokens ``[tiers[i].from_tokens, tiers[i+1].from_tokens)`` of that kind, the last tier
everything above. Only the tokens inside a band get the band's price (like income tax
brackets), so more tokens never cost less, whatever the tier prices are.
"""

from __future__ import annotations

import itertools
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

TokenKind = Literal["prompt", "cached_prompt", "completion"]
TOKEN_KINDS: tuple[TokenKind, ...] = ("prompt", "cached_prompt", "completion")

# ISO 4217 minor units that are not 2; every other currency bills in hundredths.
_MINOR_UNITS: dict[str, int] = {
    **dict.fromkeys(
        [
            "BIF",
            "CLP",
            "DJF",
            "GNF",
            "ISK",
            "JPY",
            "KMF",
            "KRW",
            "PYG",
            "RWF",
            "UGX",
            "VND",
            "VUV",
            "XAF",
            "XOF",
            "XPF",
        ],
        0,
    ),
    **dict.fromkeys(["BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"], 3),
}

# Bounds that keep every product of a price and a token count exact at the invoice
# module's working precision.
MAX_PRICE_DIGITS = 12
MAX_PRICE = Decimal(10) ** 12


def minor_units(currency: str) -> int:
    """Decimal places of the currency's minor unit (USD 2, JPY 0, KWD 3)."""
    return _MINOR_UNITS.get(currency, 2)


def minor_unit(currency: str) -> Decimal:
    """The quantum amounts are rounded to: Decimal('0.01') for USD, Decimal('1') for JPY."""
    return Decimal(1).scaleb(-minor_units(currency))


def _to_decimal(value: Any) -> Decimal:
    if isinstance(value, bool | float):
        raise ValueError("give money as a decimal string, an int or a Decimal, not a float")
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, str):
        try:
            return Decimal(value.strip())
        except ArithmeticError:
            raise ValueError(f"not a decimal number: {value!r}") from None
    if isinstance(value, Decimal):
        return value
    raise ValueError(f"not a decimal number: {value!r}")


def _check_price(value: Decimal) -> Decimal:
    if not value.is_finite():
        raise ValueError("price must be a finite number")
    if value < 0:
        raise ValueError("price must not be negative")
    if value >= MAX_PRICE:
        raise ValueError(f"price must be below {MAX_PRICE}")
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)  # finite, checked above
    if exponent < -MAX_PRICE_DIGITS:
        raise ValueError(f"price may have at most {MAX_PRICE_DIGITS} decimal places")
    return value


Price = Annotated[Decimal, BeforeValidator(_to_decimal), AfterValidator(_check_price)]


class TokenPrices(BaseModel):
    """Prices per million tokens of each kind, in the plan's currency."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_per_mtok: Price
    completion_per_mtok: Price
    cached_prompt_per_mtok: Price

    def per_mtok(self, kind: TokenKind) -> Decimal:
        if kind == "prompt":
            return self.prompt_per_mtok
        if kind == "cached_prompt":
            return self.cached_prompt_per_mtok
        return self.completion_per_mtok


class VolumeTier(BaseModel):
    """From ``from_tokens`` tokens of a kind in a month on, that kind costs ``prices``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    from_tokens: int = Field(gt=0)
    prices: TokenPrices


class PricePlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    prompt_per_mtok: Price
    completion_per_mtok: Price
    cached_prompt_per_mtok: Price
    # Per adapter hosted for a whole month; partial months are billed pro rata.
    adapter_month: Price = Decimal(0)
    monthly_minimum: Price = Decimal(0)
    volume_tiers: tuple[VolumeTier, ...] = ()
    # NOTE: an overridden adapter's tokens are billed flat at its prices: they are not
    # tiered and do not count towards the plan's tier volumes (a negotiated price is final).
    adapter_overrides: dict[str, TokenPrices] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> PricePlan:
        starts = [tier.from_tokens for tier in self.volume_tiers]
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError("volume_tiers must have strictly increasing from_tokens")
        exponent = self.monthly_minimum.as_tuple().exponent
        assert isinstance(exponent, int)
        if exponent < -minor_units(self.currency):
            raise ValueError(
                f"monthly_minimum must be a whole number of {self.currency} minor units"
            )
        return self

    @property
    def base_prices(self) -> TokenPrices:
        return TokenPrices(
            prompt_per_mtok=self.prompt_per_mtok,
            completion_per_mtok=self.completion_per_mtok,
            cached_prompt_per_mtok=self.cached_prompt_per_mtok,
        )

    def bands(self, kind: TokenKind) -> list[tuple[int, int | None, Decimal]]:
        """``(from_tokens, to_tokens or None, price per Mtok)`` for each band of a kind."""
        starts = [0, *(tier.from_tokens for tier in self.volume_tiers)]
        prices = [self.base_prices, *(tier.prices for tier in self.volume_tiers)]
        ends: list[int | None] = [*starts[1:], None]
        return [
            (start, end, price.per_mtok(kind))
            for start, end, price in zip(starts, ends, prices, strict=True)
        ]
