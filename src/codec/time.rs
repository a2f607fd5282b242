//! Instants on the wire (SEMANTICS §2): RFC 3339 UTC with exactly three fraction digits,
//! `2026-11-30T03:34:47.123Z`, for every `Millis` (ms since the epoch) settle writes or reads.
//! [`format_rfc3339_ms`] / [`write_rfc3339_ms`] write the digits directly (no `fmt`, the
//! encoder's hot path; tests hold them to the `time` crate's formatting), clamped to years
//! 0000–9999; [`parse_rfc3339_ms`] reads any offset and fraction; [`parse_timestamp`] reads
//! epoch ms or RFC 3339 from JSON (trace lines' `ts`, admin inputs); `rfc3339_ms` is the
//! serde adapter of [`ReadyRecord`](super::ReadyRecord)'s instants.

use crate::engine::Millis;

/// `0000-01-01T00:00:00.000Z` in ms: the earliest instant RFC 3339 can write.
pub const RFC3339_MIN_MS: Millis = -62_167_219_200_000;
/// `9999-12-31T23:59:59.999Z` in ms: the latest instant RFC 3339 can write.
pub const RFC3339_MAX_MS: Millis = 253_402_300_799_999;

/// Why a timestamp could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TimeError {
    /// Neither an integer nor a string (names the JSON type found).
    #[error("timestamp must be epoch milliseconds (integer) or an RFC 3339 string, got {0}")]
    WrongType(&'static str),
    /// An integer outside `i64`, or a number with a fraction.
    #[error("timestamp {0} is not an integer number of milliseconds within i64")]
    NotMillis(String),
    /// A string that is not RFC 3339.
    #[error("timestamp {text:?} is not RFC 3339: {message}")]
    NotRfc3339 {
        /// The text given.
        text: String,
        /// What the parser said.
        message: String,
    },
}

/// Bytes of an instant as [`write_rfc3339_ms`] writes it: `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub const RFC3339_MS_LEN: usize = 24;

/// Formats an instant (ms since the epoch) as RFC 3339 UTC with exactly three fraction digits,
/// e.g. `2026-11-30T03:34:47.123Z`. Instants outside years 0000–9999 are clamped to
/// [`RFC3339_MIN_MS`]..=[`RFC3339_MAX_MS`] (RFC 3339 has four-digit years).
pub fn format_rfc3339_ms(ms: Millis) -> String {
    // Every byte is ASCII (a digit or one of `-T:.Z`), so each is one char.
    rfc3339_ms_bytes(ms).into_iter().map(char::from).collect()
}

/// Appends [`format_rfc3339_ms`]`(ms)` to `out` ([`RFC3339_MS_LEN`] bytes) without allocating
/// or going through `fmt`: the hot path of [`encode_ready_into`](super::encode_ready_into).
pub fn write_rfc3339_ms(ms: Millis, out: &mut Vec<u8>) {
    out.extend_from_slice(&rfc3339_ms_bytes(ms));
}

/// The RFC 3339 text of `ms` (clamped as in [`format_rfc3339_ms`]), digits written directly:
/// days since the epoch → civil date with Howard Hinnant's `civil_from_days` (proleptic
/// Gregorian calendar, exact for every year), time of day by division.
fn rfc3339_ms_bytes(ms: Millis) -> [u8; RFC3339_MS_LEN] {
    thread_local! {
        /// The day last written and its `YYYY-MM-DD` (records of one run share a few days).
        static LAST_DAY: std::cell::Cell<(i64, [u8; 10])> =
            const { std::cell::Cell::new((i64::MIN, [0; 10])) };
    }
    let ms = ms.clamp(RFC3339_MIN_MS, RFC3339_MAX_MS);
    let (secs, milli) = (ms.div_euclid(1000), ms.rem_euclid(1000));
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let mut b = *b"0000-00-00T00:00:00.000Z";
    let date = LAST_DAY.with(|last| match last.get() {
        (d, date) if d == days => date,
        _ => {
            let (year, month, day) = civil_from_days(days);
            let mut date = *b"0000-00-00";
            // The clamp keeps the year in 0..=9999 and every other field within its digits.
            put2(&mut date[0..2], year / 100);
            put2(&mut date[2..4], year % 100);
            put2(&mut date[5..7], month);
            put2(&mut date[8..10], day);
            last.set((days, date));
            date
        }
    });
    b[..10].copy_from_slice(&date);
    put2(&mut b[11..13], sod / 3600);
    put2(&mut b[14..16], sod / 60 % 60);
    put2(&mut b[17..19], sod % 60);
    b[20] = b'0' + (milli / 100) as u8;
    put2(&mut b[21..23], milli % 100);
    b
}

/// `"00" "01" … "99"`: two digits per table entry.
const DIGIT_PAIRS: &[u8; 200] = b"\
0001020304050607080910111213141516171819202122232425262728293031323334353637383940414243444546474849\
5051525354555657585960616263646566676869707172737475767778798081828384858687888990919293949596979899";

/// Writes `v` (0..=99) as two digits into `slot` (two bytes).
fn put2(slot: &mut [u8], v: i64) {
    let i = (v as usize % 100) * 2;
    slot.copy_from_slice(&DIGIT_PAIRS[i..i + 2]);
}

/// `(year, month 1..=12, day 1..=31)` of the day `z` days after 1970-01-01 (proleptic
/// Gregorian). <https://howardhinnant.github.io/date_algorithms.html#civil_from_days>
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of era, 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of year from March 1st, 0..=365
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Parses an RFC 3339 timestamp (any offset, any fraction length) into ms since the epoch.
/// Sub-millisecond digits are truncated toward the past.
///
/// Errors: [`TimeError::NotRfc3339`].
pub fn parse_rfc3339_ms(text: &str) -> Result<Millis, TimeError> {
    let t = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
        .map_err(|e| TimeError::NotRfc3339 {
            text: text.to_owned(),
            message: e.to_string(),
        })?;
    // |years| ≤ 9999 keeps the ms value far inside i64.
    Ok(t.unix_timestamp_nanos().div_euclid(1_000_000) as Millis)
}

/// Reads a timestamp given in JSON as epoch milliseconds (an integer) or an RFC 3339 string
/// (used for trace lines' `"ts"` and admin inputs).
///
/// Errors: [`TimeError::WrongType`] (null, bool, array, object), [`TimeError::NotMillis`]
/// (fraction or out of `i64`), [`TimeError::NotRfc3339`].
pub fn parse_timestamp(v: &serde_json::Value) -> Result<Millis, TimeError> {
    use serde_json::Value;
    match v {
        Value::Number(n) => n
            .as_i64()
            .ok_or_else(|| TimeError::NotMillis(n.to_string())),
        Value::String(s) => parse_rfc3339_ms(s),
        Value::Null => Err(TimeError::WrongType("null")),
        Value::Bool(_) => Err(TimeError::WrongType("a boolean")),
        Value::Array(_) => Err(TimeError::WrongType("an array")),
        Value::Object(_) => Err(TimeError::WrongType("an object")),
    }
}

/// serde for `Millis` as an RFC 3339 string with milliseconds.
pub(super) mod rfc3339_ms {
    use super::{format_rfc3339_ms, parse_rfc3339_ms, Millis};
    use serde::{Deserialize, Deserializer, Serializer};
    use std::borrow::Cow;

    pub fn serialize<S: Serializer>(v: &Millis, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_rfc3339_ms(*v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Millis, D::Error> {
        let text = Cow::<str>::deserialize(d)?;
        parse_rfc3339_ms(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_format_and_parse() {
        assert_eq!(format_rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            format_rfc3339_ms(1_796_009_687_123),
            "2026-11-30T03:34:47.123Z"
        );
        assert_eq!(format_rfc3339_ms(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(format_rfc3339_ms(Millis::MAX), "9999-12-31T23:59:59.999Z");
        assert_eq!(format_rfc3339_ms(Millis::MIN), "0000-01-01T00:00:00.000Z");
        for ms in [
            0,
            1,
            -1,
            999,
            1_796_009_687_123,
            RFC3339_MIN_MS,
            RFC3339_MAX_MS,
        ] {
            assert_eq!(parse_rfc3339_ms(&format_rfc3339_ms(ms)), Ok(ms), "{ms}");
        }
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T04:34:47.123+01:00"),
            Ok(1_796_009_687_123)
        );
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T03:34:47Z"),
            Ok(1_796_009_687_000)
        );
        // Sub-millisecond digits go toward the past.
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T03:34:47.123999Z"),
            Ok(1_796_009_687_123)
        );
        assert_eq!(parse_rfc3339_ms("1969-12-31T23:59:59.9995Z"), Ok(-1));
        assert!(matches!(
            parse_rfc3339_ms("2026-11-30"),
            Err(TimeError::NotRfc3339 { .. })
        ));
        assert!(parse_rfc3339_ms("yesterday").is_err());
    }

    /// `time`'s own formatting of `ms` (clamped as settle clamps), the reference.
    fn time_crate_rfc3339(ms: Millis) -> String {
        let ms = ms.clamp(RFC3339_MIN_MS, RFC3339_MAX_MS);
        let t =
            time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).unwrap();
        t.format(time::macros::format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
        ))
        .unwrap()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(20_000))]

        /// The digit writer agrees with the `time` crate over every i64 settle accepts:
        /// years 0000-9999 exactly, everything beyond clamped.
        #[test]
        fn rfc3339_writer_matches_the_time_crate(
            ms in proptest::prop_oneof![
                RFC3339_MIN_MS..=RFC3339_MAX_MS,
                proptest::num::i64::ANY,
                -86_400_000_i64..86_400_000,
                proptest::sample::select(vec![
                    Millis::MIN, Millis::MAX, RFC3339_MIN_MS, RFC3339_MAX_MS,
                    RFC3339_MIN_MS - 1, RFC3339_MAX_MS + 1, 0, -1,
                    // 1600-02-29, 1900-03-01, 2000-02-29, 2100-03-01 (leap-year rules).
                    -11_670_912_000_000, -2_203_891_200_000, 951_782_400_000,
                    4_107_542_400_000,
                ]),
            ]
        ) {
            let expected = time_crate_rfc3339(ms);
            proptest::prop_assert_eq!(format_rfc3339_ms(ms), expected.clone());
            let mut out = b"x".to_vec();
            write_rfc3339_ms(ms, &mut out);
            proptest::prop_assert_eq!(&out[1..], expected.as_bytes());
            proptest::prop_assert_eq!(out.len(), 1 + RFC3339_MS_LEN);
            // The same day again (its date is remembered), and the next and previous ones.
            for later in [ms.saturating_add(1), ms.saturating_add(86_400_000), ms.saturating_sub(86_399_999)] {
                proptest::prop_assert_eq!(format_rfc3339_ms(later), time_crate_rfc3339(later));
            }
        }
    }

    #[test]
    fn timestamps_from_json() {
        use serde_json::json;
        assert_eq!(
            parse_timestamp(&json!(1_796_009_687_123_i64)),
            Ok(1_796_009_687_123)
        );
        assert_eq!(parse_timestamp(&json!(-5)), Ok(-5));
        assert_eq!(
            parse_timestamp(&json!("2026-11-30T03:34:47.123Z")),
            Ok(1_796_009_687_123)
        );
        assert!(matches!(
            parse_timestamp(&json!(1.5)),
            Err(TimeError::NotMillis(_))
        ));
        assert!(matches!(
            parse_timestamp(&json!(u64::MAX)),
            Err(TimeError::NotMillis(_))
        ));
        assert_eq!(
            parse_timestamp(&json!(null)),
            Err(TimeError::WrongType("null"))
        );
        assert!(matches!(
            parse_timestamp(&json!({})),
            Err(TimeError::WrongType(_))
        ));
        assert!(matches!(
            parse_timestamp(&json!("1796009687123")),
            Err(TimeError::NotRfc3339 { .. })
        ));
    }
}
