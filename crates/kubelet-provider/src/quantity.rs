//! Kubernetes resource quantities (`500m`, `2`, `128Mi`, `1G`, `1e3`) as
//! integers: CPU in millicores, everything else in units.

/// A quantity that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid quantity {0:?}")]
pub struct QuantityError(pub String);

/// Reads a quantity as thousandths of a unit (`500m` → 500, `2` → 2000),
/// rounding up as the API server does for CPU.
pub fn parse_milli(text: &str) -> Result<u128, QuantityError> {
    let (mantissa, scale_num, scale_den) = split(text)?;
    // value * 1000 = mantissa * scale * 1000, rounded up.
    let numerator = mantissa.0.checked_mul(scale_num).and_then(|v| v.checked_mul(1000)).ok_or_else(|| bad(text))?;
    let denominator = mantissa.1.checked_mul(scale_den).ok_or_else(|| bad(text))?;
    Ok(numerator.div_ceil(denominator))
}

/// Reads a quantity as whole units (`128Mi` → 134217728, `1500m` → 2),
/// rounding up.
pub fn parse_units(text: &str) -> Result<u128, QuantityError> {
    let (mantissa, scale_num, scale_den) = split(text)?;
    let numerator = mantissa.0.checked_mul(scale_num).ok_or_else(|| bad(text))?;
    let denominator = mantissa.1.checked_mul(scale_den).ok_or_else(|| bad(text))?;
    Ok(numerator.div_ceil(denominator))
}

fn bad(text: &str) -> QuantityError {
    QuantityError(text.to_owned())
}

/// (numerator, denominator) of the number, and the suffix's scale as a
/// fraction.
fn split(text: &str) -> Result<((u128, u128), u128, u128), QuantityError> {
    let text = text.trim();
    let number_end = text.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+')).unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    if number.is_empty() || number.starts_with('.') && number.len() == 1 {
        return Err(bad(text));
    }
    let number = number.strip_prefix('+').unwrap_or(number);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return Err(bad(text));
    }
    let digits = format!("{whole}{fraction}");
    let numerator: u128 = digits.parse().map_err(|_| bad(text))?;
    let denominator =
        10u128.checked_pow(u32::try_from(fraction.len()).map_err(|_| bad(text))?).ok_or_else(|| bad(text))?;
    let (scale_num, scale_den): (u128, u128) = match suffix {
        "" => (1, 1),
        "m" => (1, 1000),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        exponent if exponent.starts_with(['e', 'E']) => {
            let power: u32 = exponent[1..].parse().map_err(|_| bad(text))?;
            (10u128.checked_pow(power).ok_or_else(|| bad(text))?, 1)
        }
        _ => return Err(bad(text)),
    };
    Ok(((numerator, denominator), scale_num, scale_den))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_quantities_read_as_millicores() {
        assert_eq!(parse_milli("500m"), Ok(500));
        assert_eq!(parse_milli("2"), Ok(2000));
        assert_eq!(parse_milli("0.1"), Ok(100));
        assert_eq!(parse_milli("1.5"), Ok(1500));
        assert_eq!(parse_milli("0.0001"), Ok(1), "rounded up");
    }

    #[test]
    fn memory_quantities_read_as_bytes() {
        assert_eq!(parse_units("128Mi"), Ok(128 << 20));
        assert_eq!(parse_units("1G"), Ok(1_000_000_000));
        assert_eq!(parse_units("1e3"), Ok(1000));
        assert_eq!(parse_units("1500m"), Ok(2));
        assert_eq!(parse_units("3"), Ok(3));
    }

    #[test]
    fn nonsense_is_an_error() {
        for text in ["", "abc", "12Qi", "1..2", ".", "-1", "1e"] {
            assert!(parse_units(text).is_err(), "{text:?}");
        }
    }
}
