import SecurityEvents
import Testing

@Suite("RFC 3339 times")
struct RFC3339Tests {
    @Test func knownTimesAreWrittenAndReadBack() {
        let cases: [(Double, String)] = [
            (0, "1970-01-01T00:00:00.000Z"),
            (951_782_400, "2000-02-29T00:00:00.000Z"),
            (1_764_149_462.123, "2025-11-26T09:31:02.123Z"),
            (-1, "1969-12-31T23:59:59.000Z"),
            (4_107_542_399.9994, "2100-02-28T23:59:59.999Z"),
            (253_402_300_799.999, "9999-12-31T23:59:59.999Z"),
        ]
        for (seconds, text) in cases {
            #expect(RFC3339.string(from: seconds) == text)
            #expect(RFC3339.parse(text).map { ($0 * 1000).rounded() } == (seconds * 1000).rounded(), "\(text)")
        }
        #expect(RFC3339.string(from: 1_764_149_462.9996) == "2025-11-26T09:31:03.000Z", "milliseconds round up into the next second")
        // Rounding up into year 10000 is out of range: the last millisecond of 9999.
        #expect(RFC3339.string(from: 253_402_300_799.9996) == "9999-12-31T23:59:59.999Z")
    }

    /// A day the month does not have, or second 60, is no time (not a later one, normalised).
    @Test func daysTheMonthLacksAreRefused() {
        for bad in ["2026-02-29T00:00:00Z", "2026-02-31T00:00:00Z", "2026-04-31T00:00:00Z", "1900-02-29T00:00:00Z",
                    "2026-11-26T09:31:60Z"] {
            #expect(RFC3339.parse(bad) == nil, "\(bad)")
        }
        for good in ["2024-02-29T00:00:00Z", "2000-02-29T00:00:00Z", "2026-01-31T23:59:59Z", "2026-12-31T00:00:00Z"] {
            #expect(RFC3339.parse(good) != nil, "\(good)")
        }
    }

    @Test func offsetsAndCaseAreAcceptedAndNonsenseIsNot() {
        #expect(RFC3339.parse("2025-11-26T10:31:02+01:00") == RFC3339.parse("2025-11-26T09:31:02Z"))
        #expect(RFC3339.parse("2025-11-26t09:31:02.5z") == 1_764_149_462.5)
        for bad in ["2025-11-26", "2025-13-01T00:00:00Z", "2025-11-26T09:31:02", "2025-11-26T09:31:02.Z", "yesterday",
                    "2025-11-26T24:00:00Z", "2025-11-26T09:31:02+0100"] {
            #expect(RFC3339.parse(bad) == nil, "\(bad)")
        }
    }
}
