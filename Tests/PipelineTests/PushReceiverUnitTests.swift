@testable import Pipeline
import Testing

@Suite("Push receiver, pure parts")
struct PushReceiverUnitTests {
    @Test(arguments: [
        ("application/secevent+jwt", true), ("Application/SecEvent+JWT; charset=us-ascii", true),
        (" application/secevent+jwt ", true), ("application/secevent+jwt ;x=1", true),
        ("application/secevent+jwtx", false), ("application/jwt", false), ("", false),
        ("text/application/secevent+jwt", false), ("application/secevent+jw", false), ("application/secevent+jwt, text/plain", false),
    ])
    func theContentTypeIsTheSETMediaTypeWhateverItsCaseAndParameters(_ value: String, _ accepted: Bool) {
        #expect(PushReceiver.isSecurityEventToken(value) == accepted)
    }

    @Test func noContentTypeIsRefused() {
        #expect(!PushReceiver.isSecurityEventToken(nil))
    }
}
