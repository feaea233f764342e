/// RFC 3339 times in UTC, as audit records, reports and the command line spell them.
public enum RFC3339 {
    /// `2026-11-26T09:31:02.123Z`: milliseconds, always UTC.
    public static func string(from seconds: Double) -> String {
        var out: [UInt8] = []
        out.reserveCapacity(24)
        write(seconds, to: &out)
        return String(decoding: out, as: UTF8.self)
    }

    /// Appends `string(from:)`'s text as UTF-8, without making a string.
    public static func write(_ seconds: Double, to out: inout [UInt8]) {
        withUnsafeTemporaryAllocation(of: UInt8.self, capacity: length) { buffer in
            write(seconds, at: buffer.baseAddress!)
            out.append(contentsOf: UnsafeBufferPointer(buffer))
        }
    }

    /// The bytes of every time written: `2026-11-26T09:31:02.123Z`.
    public static let length = 24

    /// Writes `string(from:)`'s text as UTF-8 at `out`, which has room for `length` bytes
    /// (audit records write three per event, into a buffer made for the record).
    public static func write(_ seconds: Double, at out: UnsafeMutablePointer<UInt8>) {
        // Years 0001…9999 only, judged once rounded to the millisecond (253402300799.9996
        // rounds into year 10000); anything else is written as the last millisecond of 9999.
        let rounded = (seconds * 1000).rounded()
        guard rounded.isFinite, rounded >= -62_135_596_800_000, rounded < 253_402_300_800_000 else {
            for (i, byte) in "9999-12-31T23:59:59.999Z".utf8.enumerated() { out[i] = byte }
            return
        }
        let totalMillis = Int64(rounded)
        let millis = Int(((totalMillis % 1000) + 1000) % 1000)
        let whole = (totalMillis - Int64(millis)) / 1000
        var days = Int(whole >= 0 ? whole / 86_400 : (whole - 86_399) / 86_400)
        let secondOfDay = Int(whole - Int64(days) * 86_400)
        // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
        days += 719_468
        let era = (days >= 0 ? days : days - 146_096) / 146_097
        let dayOfEra = days - era * 146_097
        let yearOfEra = (dayOfEra - dayOfEra / 1460 + dayOfEra / 36_524 - dayOfEra / 146_096) / 365
        let dayOfYear = dayOfEra - (365 * yearOfEra + yearOfEra / 4 - yearOfEra / 100)
        let mp = (5 * dayOfYear + 2) / 153
        let day = dayOfYear - (153 * mp + 2) / 5 + 1
        let month = mp < 10 ? mp + 3 : mp - 9
        let year = yearOfEra + era * 400 + (month <= 2 ? 1 : 0)
        /// `value`'s last `width` decimal digits at `at`.
        @inline(__always) func digits(_ value: Int, _ width: Int, at: Int) {
            var v = value
            for i in stride(from: at + width - 1, through: at, by: -1) {
                out[i] = UInt8(ascii: "0") + UInt8(v % 10)
                v /= 10
            }
        }
        digits(year, 4, at: 0)
        out[4] = UInt8(ascii: "-")
        digits(month, 2, at: 5)
        out[7] = UInt8(ascii: "-")
        digits(day, 2, at: 8)
        out[10] = UInt8(ascii: "T")
        digits(secondOfDay / 3600, 2, at: 11)
        out[13] = UInt8(ascii: ":")
        digits(secondOfDay / 60 % 60, 2, at: 14)
        out[16] = UInt8(ascii: ":")
        digits(secondOfDay % 60, 2, at: 17)
        out[19] = UInt8(ascii: ".")
        digits(millis, 3, at: 20)
        out[23] = UInt8(ascii: "Z")
    }

    /// Seconds since 1970 of an RFC 3339 date-time (`2026-11-26T09:31:02Z`,
    /// `2026-11-26T10:31:02.5+01:00`, `t` and `z` in lower case too); nil when it is not one.
    public static func parse(_ text: String) -> Double? {
        let b = Array(text.utf8)
        func number(_ range: Range<Int>) -> Int? {
            guard range.upperBound <= b.count else { return nil }
            var n = 0
            for i in range {
                guard b[i] >= 0x30, b[i] <= 0x39 else { return nil }
                n = n * 10 + Int(b[i] - 0x30)
            }
            return n
        }
        guard b.count >= 20, b[4] == UInt8(ascii: "-"), b[7] == UInt8(ascii: "-"),
              b[10] == UInt8(ascii: "T") || b[10] == UInt8(ascii: "t"),
              b[13] == UInt8(ascii: ":"), b[16] == UInt8(ascii: ":"),
              let year = number(0..<4), let month = number(5..<7), let day = number(8..<10),
              let hour = number(11..<13), let minute = number(14..<16), let second = number(17..<19),
              (1...12).contains(month), day >= 1, day <= daysIn(month, of: year), hour < 24, minute < 60, second < 60
        else { return nil }
        var i = 19
        var fraction = 0.0
        if i < b.count, b[i] == UInt8(ascii: ".") {
            i += 1
            var scale = 0.1
            let start = i
            while i < b.count, b[i] >= 0x30, b[i] <= 0x39 {
                fraction += Double(b[i] - 0x30) * scale
                scale /= 10
                i += 1
            }
            guard i > start else { return nil }
        }
        guard i < b.count else { return nil }
        var offset = 0
        switch b[i] {
        case UInt8(ascii: "Z"), UInt8(ascii: "z"):
            guard i + 1 == b.count else { return nil }
        case UInt8(ascii: "+"), UInt8(ascii: "-"):
            guard i + 6 == b.count, b[i + 3] == UInt8(ascii: ":"), let h = number(i + 1..<i + 3), let m = number(i + 4..<i + 6),
                  h < 24, m < 60 else { return nil }
            offset = (h * 3600 + m * 60) * (b[i] == UInt8(ascii: "+") ? 1 : -1)
        default:
            return nil
        }
        // Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
        let y = month <= 2 ? year - 1 : year
        let era = (y >= 0 ? y : y - 399) / 400
        let yearOfEra = y - era * 400
        let dayOfYear = (153 * (month + (month > 2 ? -3 : 9)) + 2) / 5 + day - 1
        let dayOfEra = yearOfEra * 365 + yearOfEra / 4 - yearOfEra / 100 + dayOfYear
        let days = era * 146_097 + dayOfEra - 719_468
        return Double(days * 86_400 + hour * 3600 + minute * 60 + second - offset) + fraction
    }

    /// The days of `month` in `year` (proleptic Gregorian): 2026-02-31 is no date, and is
    /// refused rather than read as March 3.
    static func daysIn(_ month: Int, of year: Int) -> Int {
        switch month {
        case 2: year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) ? 29 : 28
        case 4, 6, 9, 11: 30
        default: 31
        }
    }
}
