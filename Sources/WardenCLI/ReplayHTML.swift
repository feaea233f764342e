import Foundation
import SecurityEvents

/// `warden replay --html`: one self-contained page (inline SVG and CSS, no script, nothing
/// fetched) with a timeline of events by status, counts by type and status, and the
/// discrepancies listed.
enum ReplayHTML {
    typealias Status = ReplayFinding.Status

    static let colors: [Status: String] = [
        .ok: "#3a9d5d", .invalid: "#9aa0a6", .duplicate: "#c5cae9", .neverProcessed: "#d93025",
        .plannedNotDone: "#f29900", .verdictChanged: "#8e24aa", .notInLog: "#1a73e8",
        .beyondRetention: "#5f6368",
    ]

    static func render(_ statistics: ReplayStatistics, title: String, applied: Bool, generatedAt: Double = Date().timeIntervalSince1970) -> String {
        var html = """
        <!DOCTYPE html>
        <html lang="en"><head><meta charset="utf-8">
        <meta name="viewport" content="width=device-width, initial-scale=1">
        <title>warden replay: \(escape(title))</title>
        <style>
        body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1100px;color:#202124;padding:0 16px}
        h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
        .meta{color:#5f6368}.cards{display:flex;gap:12px;flex-wrap:wrap;margin:16px 0}
        .card{border:1px solid #dadce0;border-radius:8px;padding:10px 14px;min-width:120px}
        .card b{display:block;font-size:22px}.bad b{color:#d93025}
        table{border-collapse:collapse;width:100%}th,td{border-bottom:1px solid #e8eaed;padding:5px 8px;text-align:left;vertical-align:top}
        th{background:#f8f9fa;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
        .sw{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:5px;vertical-align:-1px}
        .legend span{margin-right:14px;white-space:nowrap}code{font-size:12px;word-break:break-all}
        svg text{font:11px system-ui,sans-serif;fill:#5f6368}
        </style></head><body>
        <h1>warden replay\(applied ? " --apply" : "")</h1>
        <div class="meta">\(escape(title)) · generated \(RFC3339.string(from: generatedAt))</div>
        <div class="cards">
        <div class="card"><b>\(statistics.entries)</b>entries</div>
        <div class="card\(statistics.discrepancyCount > 0 ? " bad" : "")"><b>\(statistics.discrepancyCount)</b>discrepancies</div>
        """
        for status in Status.allCases where statistics.byStatus[status, default: 0] > 0 {
            html += "<div class=\"card\"><b>\(statistics.byStatus[status]!)</b><span class=\"sw\" style=\"background:\(colors[status]!)\"></span>\(status.rawValue)</div>\n"
        }
        if applied { html += "<div class=\"card\"><b>\(statistics.repaired)</b>repaired</div><div class=\"card\(statistics.unrepaired > 0 ? " bad" : "")\"><b>\(statistics.unrepaired)</b>not repaired</div>\n" }
        html += "</div>\n<h2>Timeline</h2>\n" + timeline(statistics) + legend()
        if statistics.unchartedEntries > 0 {
            html += "<p class=\"meta\">\(statistics.unchartedEntries) entries claim times beyond the chart's \(ReplayStatistics.maximumHours) hours and are counted but not charted.</p>\n"
        }
        html += "<h2>By event type</h2>\n<table><tr><th>type</th><th>total</th>"
        let statuses = Status.allCases.filter { statistics.byStatus[$0, default: 0] > 0 }
        for status in statuses { html += "<th><span class=\"sw\" style=\"background:\(colors[status]!)\"></span>\(status.rawValue)</th>" }
        html += "</tr>\n"
        for type in statistics.byType.keys.sorted() {
            let counts = statistics.byType[type]!
            html += "<tr><td>\(escape(type))</td><td class=\"n\">\(counts.values.reduce(0, +))</td>"
            for status in statuses { html += "<td class=\"n\">\(counts[status].map(String.init) ?? "")</td>" }
            html += "</tr>\n"
        }
        html += "</table>\n<h2>Discrepancies</h2>\n"
        if statistics.discrepancies.isEmpty {
            html += "<p>None: the ledger matches the log.</p>\n"
        } else {
            if statistics.discrepancyCount > statistics.discrepancies.count {
                html += "<p>The first \(statistics.discrepancies.count) of \(statistics.discrepancyCount) are listed; the report (--report) has every one.</p>\n"
            }
            html += "<table><tr><th>where</th><th>status</th><th>types</th><th>issuer</th><th>jti</th><th>time</th><th>ledger steps</th>\(applied ? "<th>applied</th>" : "")</tr>\n"
            for finding in statistics.discrepancies {
                let steps = finding.ledgerSteps.map { $0.map { "\($0.kind): \($0.status.rawValue)" }.joined(separator: ", ") } ?? ""
                html += "<tr><td>\(escape(finding.position))</td>"
                html += "<td><span class=\"sw\" style=\"background:\(colors[finding.status]!)\"></span>\(finding.status.rawValue)</td>"
                html += "<td>\(escape(finding.types.joined(separator: ", ")))</td><td>\(escape(finding.issuer ?? ""))</td>"
                html += "<td><code>\(escape(finding.jti ?? ""))</code></td><td>\(finding.time.map { RFC3339.string(from: $0) } ?? "")</td>"
                html += "<td>\(escape(steps))</td>\(applied ? "<td>\(escape(finding.applied ?? ""))</td>" : "")</tr>\n"
            }
            html += "</table>\n"
        }
        html += "</body></html>\n"
        return html
    }

    static func legend() -> String {
        "<div class=\"legend\">" + Status.allCases.map {
            "<span><span class=\"sw\" style=\"background:\(colors[$0]!)\"></span>\($0.rawValue)</span>"
        }.joined() + "</div>\n"
    }

    /// A stacked bar chart of entries by status over time: the log's span cut into at most 60
    /// bars of whole hours.
    static func timeline(_ statistics: ReplayStatistics) -> String {
        guard let first = statistics.timeline.keys.min(), let last = statistics.timeline.keys.max() else {
            return "<p>No entry has a time.</p>\n"
        }
        let hours = last - first + 1
        let perBar = max(1, (hours + 59) / 60)
        let bars = (hours + perBar - 1) / perBar
        var counts = Array(repeating: [Status: Int](), count: bars)
        for (hour, byStatus) in statistics.timeline {
            let bar = (hour - first) / perBar
            for (status, n) in byStatus { counts[bar][status, default: 0] += n }
        }
        let tallest = max(1, counts.map { $0.values.reduce(0, +) }.max() ?? 1)
        let width = 1000.0, height = 220.0, left = 48.0, bottom = 36.0
        let barWidth = (width - left) / Double(bars)
        var svg = "<svg viewBox=\"0 0 \(Int(width)) \(Int(height + bottom))\" width=\"100%\" role=\"img\" aria-label=\"entries over time by status\">\n"
        for fraction in [0.0, 0.5, 1.0] {
            let y = height - fraction * (height - 10)
            svg += "<line x1=\"\(left)\" x2=\"\(width)\" y1=\"\(y)\" y2=\"\(y)\" stroke=\"#e8eaed\"/>"
            svg += "<text x=\"\(left - 6)\" y=\"\(y + 4)\" text-anchor=\"end\">\(Int((Double(tallest) * fraction).rounded()))</text>\n"
        }
        for (i, byStatus) in counts.enumerated() {
            var y = height
            let x = left + Double(i) * barWidth
            for status in Status.allCases {
                guard let n = byStatus[status], n > 0 else { continue }
                let h = Double(n) / Double(tallest) * (height - 10)
                y -= h
                let start = RFC3339.string(from: Double((first + i * perBar) * 3600))
                svg += "<rect x=\"\(x + 1)\" y=\"\(y)\" width=\"\(max(1, barWidth - 2))\" height=\"\(h)\" fill=\"\(colors[status]!)\"><title>\(start): \(n) \(status.rawValue)</title></rect>\n"
            }
        }
        let labels = min(bars, 6)
        for k in 0..<labels {
            let i = labels == 1 ? 0 : k * (bars - 1) / (labels - 1)
            let x = left + (Double(i) + 0.5) * barWidth
            let text = String(RFC3339.string(from: Double((first + i * perBar) * 3600)).prefix(16)).replacingOccurrences(of: "T", with: " ")
            svg += "<text x=\"\(x)\" y=\"\(height + 20)\" text-anchor=\"middle\">\(text)</text>\n"
        }
        svg += "</svg>\n"
        svg += "<div class=\"meta\">\(perBar == 1 ? "one bar per hour" : "one bar per \(perBar) hours") (UTC)</div>\n"
        return svg
    }

    /// Escapes per Unicode scalar, not per character: a combining or prepending mark joins the
    /// `<` beside it into one character that a character comparison would let through.
    static func escape(_ text: String) -> String {
        var out = String.UnicodeScalarView()
        for scalar in text.unicodeScalars {
            switch scalar {
            case "&": out.append(contentsOf: "&amp;".unicodeScalars)
            case "<": out.append(contentsOf: "&lt;".unicodeScalars)
            case ">": out.append(contentsOf: "&gt;".unicodeScalars)
            case "\"": out.append(contentsOf: "&quot;".unicodeScalars)
            case "'": out.append(contentsOf: "&#39;".unicodeScalars)
            default: out.append(scalar)
            }
        }
        return String(out)
    }
}
